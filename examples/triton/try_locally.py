"""Try a repository written by `dspark-export triton` on this machine: start the `tritonserver` of the PyPI wheel
nvidia-pytriton on 127.0.0.1, send one streamed request through Triton's HTTP generate extension, print the text
as it arrives, then stop the server. Run it with the Python of the venv that holds nvidia-pytriton and dspark (the
repository's EXECUTION_ENV_PATH); docs/serving.md has the whole recipe.

    VENV/bin/python examples/triton/try_locally.py REPO [--model dspark] [--prompt TEXT] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

READY_WAIT_S = 180  # a bound: a model that never gets ready fails with the server's log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wheel_site() -> Path:
    """site-packages holding nvidia-pytriton (this interpreter's)."""
    try:
        import pytriton
    except ImportError:
        sys.exit("error: nvidia-pytriton is not installed in this Python; run this script with the Python of the "
                 "venv the recipe in docs/serving.md makes")
    return Path(pytriton.__file__).resolve().parents[1]


def start(repo: Path, work: Path, ports: dict[str, int]) -> subprocess.Popen:
    from dspark.serve.triton import python_backend_dir

    site = wheel_site()
    backends = python_backend_dir(site, work / "backends")
    server = site / "pytriton" / "tritonserver" / "bin" / "tritonserver"
    cmd = [str(server), "--model-repository", str(repo), "--backend-directory", str(backends)]
    for kind, port in ports.items():
        cmd += [f"--{kind}-address", "127.0.0.1", f"--{kind}-port", str(port)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(site / "nvidia_pytriton.libs")}
    log = (work / "tritonserver.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_WAIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"error: tritonserver exited {process.returncode}; its log ends:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    sys.exit(f"error: the model was not ready within {READY_WAIT_S} s; the log ends:\n{log.read_text()[-3000:]}")


def generate(url: str, prompt: str, max_tokens: int) -> str:
    """One request to /generate_stream (greedy): the text pieces as server-sent events arrive."""
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    text, finish = [], ""
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                sys.exit(f"error: Triton answered: {event['error']}")
            text.append(event.get("text_output", ""))
            print(text[-1], end="", flush=True)
            finish = event.get("finish_reason") or finish
    print(f"\n[finish_reason: {finish}]")
    return "".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path, help="model repository written by dspark-export triton")
    ap.add_argument("--model", default="dspark", help="the model's name in the repository")
    ap.add_argument("--prompt", default="Name three primary colors.")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    if not (args.repo / args.model / "config.pbtxt").is_file():
        sys.exit(f"error: {args.repo / args.model / 'config.pbtxt'} not found: write the repository with "
                 f"dspark-export triton first")
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    with tempfile.TemporaryDirectory(prefix="dspark-triton-") as tmp:
        work = Path(tmp)
        process = start(args.repo.resolve(), work, ports)
        try:
            base = f"http://127.0.0.1:{ports['http']}/v2/models/{args.model}"
            wait_ready(process, base + "/ready", work / "tritonserver.log")
            print(f"tritonserver ready on 127.0.0.1:{ports['http']} (HTTP), {ports['grpc']} (gRPC), metrics on "
                  f"{ports['metrics']}", file=sys.stderr)
            generate(base + "/generate_stream", args.prompt, args.max_tokens)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


if __name__ == "__main__":
    main()
