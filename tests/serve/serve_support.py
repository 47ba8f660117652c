"""Helpers of the serving tests: `dspark serve` in a subprocess on 127.0.0.1, polling with a bound."""
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from support.polling import wait_until

READY_WAIT_S = 120  # a bound, not a measurement: a server that never gets ready fails the test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str):
        import httpx

        return httpx.get(self.url + path, timeout=30)

    def metric(self, name: str, missing: float | None = None) -> float:
        """The value of a sample (or the sum over a metric's labelled samples); `missing` if none is exported yet."""
        total, found = 0.0, False
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found and missing is not None:
            return missing
        assert found, f"{name} not in /metrics"
        return total

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


# a fault for tests that need requests which take a while: every graph call of the server sleeps first
SLOW_GRAPHS = """
import time
from dspark.runtime.ort_backend import OrtGraph
_run = OrtGraph.run
def _slow(self, *args, **kwargs):
    time.sleep(0.05)
    return _run(self, *args, **kwargs)
OrtGraph.run = _slow
"""


def start_server(bundle, log: Path, *args: str, prelude: str = "") -> Server:
    """`prelude`: Python run in the server's process before the command (e.g. SLOW_GRAPHS)."""
    port = free_port()
    cmd = [sys.executable, "-c", prelude + "\nfrom dspark.cli import main_cli; main_cli()", "serve", str(bundle),
           "--port", str(port), "--threads", "1", "--log-level", "warning", *args]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    server = Server(process, port, log)

    def ready():
        if process.poll() is not None:
            raise AssertionError(f"dspark serve exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            return server.get("/health").status_code == 200
        except Exception:
            return False

    assert wait_until(ready, READY_WAIT_S, 0.2), log.read_text()[-2000:]
    return server


def post(server, body, path="/v1/completions", **kw):
    content = body if isinstance(body, (bytes, str, Iterator)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=60, **kw)


def error_of(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    return error
