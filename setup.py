from setuptools import find_packages, setup

RUNTIME = ["numpy>=1.24", "onnxruntime>=1.18", "tokenizers>=0.19", "click>=8.1", "jinja2>=3.1"]
EXPORT = [
    "torch==2.13.0",  # pinned: a bare torch requirement pulls a multi-GB CUDA build on CPU boxes
    "transformers>=4.56",
    "onnx>=1.17",
    "onnxscript>=0.3",
    "polygraphy>=0.49",
    "safetensors>=0.4",
    "gguf>=0.10",
    "accelerate>=1.0",
    "tqdm>=4.66",
    "matplotlib>=3.8",
]
TRT = ["tensorrt>=10", "cuda-python>=12"]
RTX = ["tensorrt-rtx-cu13>=1.7,<1.8", "cuda-python>=12"]  # dspark-export build --flavor rtx (builds without a GPU)
# dspark serve; llguidance: structured outputs (response_format), also through the Python API
SERVE = ["fastapi>=0.110", "uvicorn>=0.29", "prometheus-client>=0.20", "llguidance>=1.0"]
# tensorrt-rtx-cu13: CI builds real engines with TensorRT for RTX (its builder needs no GPU); pinned to the minor
# release whose loader work-around dspark.trt.rtx_libs was measured on
DEV = ["pytest>=8", "hypothesis>=6.100", "scipy>=1.10", "jsonschema>=4", "tensorrt-rtx-cu13>=1.7,<1.8"]
# the serving tests: the server, the official openai client, tritonclient (the tritonserver binary of
# nvidia-pytriton pins numpy<2, so tests/serve/test_triton.py installs it into a venv of its own)
DEV += SERVE + ["openai>=1.30", "httpx>=0.27", "tritonclient[grpc]>=2.40"]

setup(
    name="dspark",
    version="0.1.0",
    description="ONNX/TensorRT export and a lightweight runtime for DSpark speculative decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dspark", "dspark.*"]),
    package_data={"dspark": ["assets/**/*", "ops/*.cu", "ops/*.h", "ops/trt_plugin/*"]},
    include_package_data=True,
    install_requires=RUNTIME,
    extras_require={"export": EXPORT, "trt": TRT, "rtx": RTX, "dev": DEV, "serve": SERVE, "all": EXPORT + DEV},
    entry_points={
        "console_scripts": ["dspark-export=dspark.cli:export_main", "dspark=dspark.cli:dspark_main"],
        # backends of dspark.runtime, found by name (dspark.runtime.backend): the runtime never imports dspark.trt
        "dspark.backends": ["onnxruntime = dspark.runtime.ort_backend:OrtBackend",
                            "tensorrt = dspark.trt.backend:TrtBackend"],
    },
)
