"""`dspark-export triton` against a real Triton Inference Server: the tritonserver binary and Python backend of the
PyPI wheel nvidia-pytriton, on 127.0.0.1, CPU only. The wheel pins numpy < 2, so it lives in its own venv (made
once, kept in the dspark cache), which is also the model's EXECUTION_ENV_PATH: the backend stub runs model.py
with that venv's packages (the runtime's dependencies, and this checkout through a .pth file)."""
import os
import queue
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.sampling import SamplingParams
from dspark.serve.triton import python_backend_dir
from serve_support import free_port, wait_until

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import np_to_triton_dtype  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
TRITON_VENV = Path(os.environ.get("DSPARK_TRITON_VENV", Path.home() / ".cache/dspark/triton-venv"))
TRITON_PACKAGES = ["nvidia-pytriton", "numpy<2", "onnxruntime", "tokenizers", "jinja2", "click"]


def triton_venv() -> Path:
    """The venv with nvidia-pytriton and the runtime's dependencies (installed on first use)."""
    python = TRITON_VENV / "bin" / "python"
    marker = TRITON_VENV / ".dspark-ready"
    if not marker.exists():
        shutil.rmtree(TRITON_VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(TRITON_VENV)], check=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *TRITON_PACKAGES], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.fail(f"could not install {TRITON_PACKAGES} into {TRITON_VENV}: {done.stderr[-1500:]}")
        marker.write_text("ok\n")
    site = next((TRITON_VENV / "lib").glob("python3*/site-packages"))
    (site / "dspark_checkout.pth").write_text(f"{REPO_ROOT}\n")  # this checkout's dspark, wherever it is
    return site


@pytest.fixture(scope="module")
def triton(tiny_bundle_v6, tmp_path_factory):
    site = triton_venv()
    wheel = site / "pytriton" / "tritonserver"
    tmp = tmp_path_factory.mktemp("triton")
    python_backend_dir(site, tmp / "backends")
    subprocess.run([sys.executable, "-c", "from dspark.cli import export_cli; export_cli()", "triton",
                    str(tiny_bundle_v6[3]), "--output", str(tmp / "repo"), "--batch-size", "2",
                    "--max-context", "64", "--python-env", str(TRITON_VENV)], check=True)
    http, grpc, metrics = free_port(), free_port(), free_port()
    log = tmp / "tritonserver.log"
    env = {**os.environ, "LD_LIBRARY_PATH": str(site / "nvidia_pytriton.libs")}
    process = subprocess.Popen([str(wheel / "bin" / "tritonserver"), "--model-repository", str(tmp / "repo"),
                                "--backend-directory", str(tmp / "backends"), "--http-address", "127.0.0.1",
                                "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
                                "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                               stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)

    def ready():
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"http://127.0.0.1:{http}/v2/models/dspark/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert wait_until(ready, 180, 0.5), log.read_text()[-3000:]
        yield {"grpc": f"127.0.0.1:{grpc}", "metrics": f"http://127.0.0.1:{metrics}/metrics", "repo": tmp / "repo"}
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def tensor(name, array):
    t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def stream(address, inputs):
    """Responses of one decoupled request: (token ids, text pieces, finish reason) in arrival order."""
    client = grpcclient.InferenceServerClient(address)
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("dspark", inputs, request_id="1")
        ids, pieces, finish = [], [], ""
        while not finish:
            result, error = responses.get(timeout=120)
            assert error is None, error
            ids.append(result.as_numpy("token_ids").tolist())
            pieces.append(result.as_numpy("text_output")[0].decode())
            finish = result.as_numpy("finish_reason")[0].decode()
        return ids, pieces, finish
    finally:
        client.stop_stream()
        client.close()


def test_triton_greedy_tokens_equal_dspark_run_and_stream(tiny_bundle_v6, triton):
    rt = Runtime(tiny_bundle_v6[3], threads=1)
    for prompt in ([1, 2, 3], [4, 1, 0, 2], [3]):
        expected = rt.generate([prompt], DecodeOptions(max_tokens=16))[0]
        ids, pieces, finish = stream(triton["grpc"], [tensor("prompt_ids", np.array(prompt, dtype=np.int64)),
                                                       tensor("max_tokens", np.array([16], dtype=np.int32))])
        assert sum(ids, []) == expected.token_ids
        assert "".join(pieces) == expected.text
        assert len([i for i in ids if i]) > 1  # several responses: it streamed
        assert finish in ("stop", "length")
    text = "w2 w4 w1"
    # the model's default policy here is ar (the bundle has no SPS table); a seed keys the tokens of one policy
    expected = rt.generate([text], DecodeOptions(max_tokens=12, temperature=1.0, seed=4, policy="ar"))[0]
    ids, _, _ = stream(triton["grpc"], [tensor("text_input", np.array([text.encode()], dtype=np.object_)),
                                        tensor("max_tokens", np.array([12], dtype=np.int32)),
                                        tensor("temperature", np.array([1.0], dtype=np.float32)),
                                        tensor("seed", np.array([4], dtype=np.int64))])
    assert sum(ids, []) == expected.token_ids
    params = SamplingParams(top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.4,
                            frequency_penalty=0.2, logit_bias={1: -2.0, 4: 1.0})
    expected = rt.generate([text], DecodeOptions(max_tokens=12, temperature=1.0, seed=4, policy="ar",
                                                 sampling=params))[0]
    scalars = {"top_k": np.int32(3), "top_p": np.float32(0.9), "min_p": np.float32(0.05),
               "repetition_penalty": np.float32(1.3), "presence_penalty": np.float32(0.4),
               "frequency_penalty": np.float32(0.2)}
    ids, _, _ = stream(triton["grpc"], [tensor("text_input", np.array([text.encode()], dtype=np.object_)),
                                        tensor("max_tokens", np.array([12], dtype=np.int32)),
                                        tensor("temperature", np.array([1.0], dtype=np.float32)),
                                        tensor("seed", np.array([4], dtype=np.int64)),
                                        *(tensor(k, np.array([v])) for k, v in scalars.items()),
                                        tensor("logit_bias_ids", np.array([1, 4], dtype=np.int64)),
                                        tensor("logit_bias_values", np.array([-2.0, 1.0], dtype=np.float32))])
    assert sum(ids, []) == expected.token_ids
    rt.close()


def test_triton_refuses_bad_input_and_serves_its_metrics(triton):
    client = grpcclient.InferenceServerClient(triton["grpc"])
    errors = queue.Queue()
    client.start_stream(callback=lambda result, error: errors.put(error))
    client.async_stream_infer("dspark", [tensor("prompt_ids", np.array([1, 99], dtype=np.int64))])
    error = errors.get(timeout=60)
    assert error is not None and "0..5" in str(error)  # the id beyond the vocabulary, named in one line
    client.async_stream_infer("dspark", [tensor("prompt_ids", np.array([1, 2, 3], dtype=np.int64)),
                                         tensor("max_tokens", np.array([100], dtype=np.int32))])
    error = errors.get(timeout=60)  # fits the bundle's 256 positions, not the repository's --max-context 64
    assert error is not None and "context of 64 positions" in str(error)
    client.async_stream_infer("dspark", [tensor("prompt_ids", np.array([1, 2, 3], dtype=np.int64)),
                                         tensor("top_p", np.array([1.5], dtype=np.float32))])
    error = errors.get(timeout=60)
    assert error is not None and "top_p must be" in str(error)
    client.stop_stream()
    assert "nv_inference_request_success" in httpx.get(triton["metrics"], timeout=10).text


def recipe_lines() -> list[str]:
    """The local Triton recipe of docs/serving.md, one command per line."""
    text = (REPO_ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- triton-recipe -->\n```bash\n(.*?)```", text, flags=re.DOTALL)
    assert block, "docs/serving.md has no triton-recipe block"
    return block.group(1).strip().splitlines()


def test_the_docs_recipe_writes_a_repository_for_the_demo_bundle_and_streams_one_request(tiny_bundle_v6, triton,
                                                                                          tmp_path):
    """The recipe's last two lines as written (its venv line is what triton_venv() does), with the tiny bundle as
    the demo's and the paths under tmp_path; its text equals the runtime's greedy decode of the prompt."""
    from dspark.demo import demo_bundle_path

    venv_line, export_line, try_line = recipe_lines()
    assert "nvidia-pytriton" in venv_line and "numpy<2" in venv_line
    env = {**os.environ, "DSPARK_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    os.environ["DSPARK_CACHE"], saved = env["DSPARK_CACHE"], os.environ.get("DSPARK_CACHE")
    try:
        own = demo_bundle_path("gguf")
    finally:
        if saved is None:
            del os.environ["DSPARK_CACHE"]
        else:
            os.environ["DSPARK_CACHE"] = saved
    shutil.copytree(tiny_bundle_v6[3], own)
    (tmp_path / ".cache" / "dspark").mkdir(parents=True, exist_ok=True)
    (tmp_path / ".cache" / "dspark" / "triton-venv").symlink_to(TRITON_VENV)  # ~ is tmp_path here
    prompt = "w1 w2 w3"
    try_line = try_line.replace('"Name three primary colors."', f'"{prompt}"')
    for line in (export_line, try_line):
        done = subprocess.run(["bash", "-c", line], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=400)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert (tmp_path / "dspark-triton-repo" / "dspark" / "config.pbtxt").is_file()
    printed = done.stdout.splitlines()
    with Runtime(own, threads=1) as rt:
        expected = rt.generate([prompt], DecodeOptions(max_tokens=48))[0]  # text: through the chat template
    assert "\n".join(printed[:-1]) == expected.text
    assert printed[-1] in ("[finish_reason: stop]", "[finish_reason: length]")
