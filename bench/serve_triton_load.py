"""A short load run against the Triton deployment of `dspark-export triton`: the real `tritonserver` of the PyPI
wheel nvidia-pytriton (its own venv, as tests/serve/test_triton.py makes it: ~/.cache/dspark/triton-venv) on a
repository written for the bundle, closed-loop clients streaming over gRPC (decoupled model: one response per
committed piece). Reports tokens/s, requests/s, TTFT, per-request inter-token time and end-to-end P50/P90/P99,
success rate, and whether greedy tokens equal the in-process runtime's (what `dspark run` gives).

    python bench/serve_triton_load.py --bundle ~/.cache/dspark/bundles/<demo bundle>
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from common import ROOT, dev_rows, machine, write_json

import httpx  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import np_to_triton_dtype  # noqa: E402

from dspark.runtime import DecodeOptions, Runtime  # noqa: E402
from dspark.serve.triton import python_backend_dir  # noqa: E402

TRITON_VENV = Path(os.environ.get("DSPARK_TRITON_VENV", Path.home() / ".cache/dspark/triton-venv"))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_triton(args, tmp: Path) -> tuple[subprocess.Popen, str]:
    if not (TRITON_VENV / ".dspark-ready").exists():
        raise SystemExit(f"no Triton venv at {TRITON_VENV}: run tests/serve/test_triton.py once to make it")
    site = next((TRITON_VENV / "lib").glob("python3*/site-packages"))
    (site / "dspark_checkout.pth").write_text(f"{ROOT}\n")
    wheel = site / "pytriton" / "tritonserver"
    python_backend_dir(site, tmp / "backends")
    subprocess.run([sys.executable, "-c", "from dspark.cli import export_cli; export_cli()", "triton",
                    str(args.bundle), "--output", str(tmp / "repo"), "--batch-size", str(args.batch_size),
                    "--policy", args.policy, "--max-context", str(args.max_context),
                    "--python-env", str(TRITON_VENV)], check=True)
    http, grpc, metrics = free_port(), free_port(), free_port()
    log = tmp / "tritonserver.log"
    process = subprocess.Popen([str(wheel / "bin" / "tritonserver"), "--model-repository", str(tmp / "repo"),
                                "--backend-directory", str(tmp / "backends"), "--http-address", "127.0.0.1",
                                "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
                                "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                               stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "LD_LIBRARY_PATH": str(site / "nvidia_pytriton.libs")})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"tritonserver exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{http}/v2/models/dspark/ready", timeout=5).status_code == 200:
                return process, f"127.0.0.1:{grpc}"
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"tritonserver not ready in 600 s: {log.read_text()[-3000:]}")


def tensor(name: str, array: np.ndarray):
    t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def one_request(address: str, prompt: str, max_tokens: int, request_id: str) -> dict:
    client = grpcclient.InferenceServerClient(address)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
    start = time.perf_counter()
    stamps, ids, finish = [], [], ""
    try:
        client.async_stream_infer("dspark", [tensor("text_input", np.array([prompt.encode()], dtype=np.object_)),
                                             tensor("max_tokens", np.array([max_tokens], dtype=np.int32))],
                                  request_id=request_id)
        while not finish:
            at, result, error = responses.get(timeout=600)
            if error is not None:
                return {"ok": False, "error": str(error)[:200]}
            piece = result.as_numpy("token_ids").tolist()
            if piece:
                stamps.append(at)
                ids += piece
            finish = result.as_numpy("finish_reason")[0].decode()
    finally:
        client.stop_stream()
        client.close()
    end = time.perf_counter()
    return {"ok": True, "ids": ids, "tokens": len(ids), "start": start, "end": end, "ttft": stamps[0] - start,
            "itl": (stamps[-1] - stamps[0]) / max(len(ids) - 1, 1), "e2e": end - start}


def percentiles(values) -> dict:
    values = list(values)
    return {f"p{q}": round(float(np.percentile(values, q)), 5) for q in (50, 90, 99)} if values else {}


def closed_loop(address: str, prompts: list[str], concurrency: int, n: int, max_tokens: int) -> list[dict]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda i: one_request(address, prompts[i % len(prompts)], max_tokens, str(i)),
                             range(n)))


def summarize(results: list[dict], concurrency: int) -> dict:
    ok = [r for r in results if r["ok"]]
    wall = max(r["end"] for r in ok) - min(r["start"] for r in ok) if ok else 0.0
    tokens = sum(r["tokens"] for r in ok)
    return {"concurrency": concurrency, "requests": len(results), "success_rate": len(ok) / len(results),
            "tokens": tokens, "tokens_per_s": round(tokens / wall, 3) if wall else 0.0,
            "requests_per_s": round(len(ok) / wall, 4) if wall else 0.0,
            "ttft_s": percentiles(r["ttft"] for r in ok), "itl_s": percentiles(r["itl"] for r in ok),
            "e2e_s": percentiles(r["e2e"] for r in ok),
            "errors": sorted({r["error"] for r in results if not r["ok"]})}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_triton_load.json")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4, 8])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--policy", default="schedule+gate")
    args = ap.parse_args()
    prompts = [r["prompt"] for r in dev_rows(None, per_domain=2)][:args.prompts]
    with Runtime(args.bundle) as rt:
        reference = [r.token_ids for r in rt.generate(prompts, DecodeOptions(max_tokens=args.max_tokens,
                                                                               batch_size=1))]
    tmp = Path(tempfile.mkdtemp(prefix="dspark-triton-bench-"))
    started = time.perf_counter()
    process, address = start_triton(args, tmp)
    try:
        closed_loop(address, prompts[:1], 1, 1, 4)  # warm-up: first calls of every graph
        points, equal = [], None
        for c in args.concurrency:
            results = closed_loop(address, prompts, c, max(len(prompts), 2 * c), args.max_tokens)
            if c == 1:
                equal = sum(r.get("ids") == ref for r, ref in zip(results, reference))
            points.append(summarize(results, c))
            print(json.dumps(points[-1]), flush=True)
    finally:
        process.terminate()
        process.wait(120)
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"bundle": str(args.bundle), "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
              "server": "tritonserver (nvidia-pytriton wheel), Python backend, decoupled, 1 instance, gRPC streaming",
              "minutes": round((time.perf_counter() - started) / 60, 1),
              "greedy_equal_to_runtime": {"prompts": len(prompts), "equal": equal}, "points": points}
    write_json(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
