"""SIGTERM under load: every accepted request either finishes or gets an error; the server exits 0."""
import json
import threading

import httpx
import pytest

from serve_support import SLOW_GRAPHS, start_server, wait_until


@pytest.fixture(scope="module")
def draining_server(tiny_bundle_v6, tmp_path_factory):
    # slowed graph calls: 240 tokens take many seconds, so SIGTERM finds every request in a slot or queued
    srv = start_server(tiny_bundle_v6[3], tmp_path_factory.mktemp("serve") / "server.log",
                       "--batch-size", "2", "--max-queue", "8", "--grace", "0", "--model-name", "tiny",
                       prelude=SLOW_GRAPHS)
    yield srv
    srv.stop()


def stream_outcome(url: str, body: dict, accepted: threading.Event, outcomes: list) -> None:
    """What one streaming client saw: 'finished' ([DONE] after a finish_reason), 'error' (an error event then
    [DONE], or an error status), 'refused' (it could not connect), or 'dropped' (the stream ended without either:
    an accepted request lost). `accepted` is set once the server answered the request's headers (or it failed)."""
    finish, error, done = None, False, False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            accepted.set()
            if response.status_code != 200:
                outcomes.append("error")
                return
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    error = error or "error" in event
                    finish = finish or (event.get("choices") or [{}])[0].get("finish_reason")
    except httpx.ConnectError:  # the server had stopped listening: never accepted, so nothing to drop
        outcomes.append("refused")
        return
    except httpx.TransportError as e:
        outcomes.append(f"dropped ({type(e).__name__})")
        return
    finally:
        accepted.set()
    outcomes.append("finished" if done and finish else "error" if done and error else "dropped")


def test_sigterm_under_load_finishes_or_fails_every_request(draining_server):
    srv = draining_server
    outcomes, threads, accepted = [], [], []
    for _ in range(6):
        body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 240, "temperature": 0, "stream": True}
        accepted.append(threading.Event())
        threads.append(threading.Thread(target=stream_outcome, args=(srv.url, body, accepted[-1], outcomes)))
        threads[-1].start()
    # every request accepted (two decoding, four queued) before SIGTERM: a connection still in the kernel's
    # backlog when the listener closes is reset, which no HTTP server can answer
    assert wait_until(lambda: all(event.is_set() for event in accepted))
    assert srv.stop() == 0, srv.log.read_text()[-2000:]
    for thread in threads:
        thread.join(120)
    assert len(outcomes) == 6
    assert not [o for o in outcomes if o.startswith("dropped")], outcomes
    assert "error" in outcomes  # grace 0: in-flight requests were cancelled, and told so


# loading takes seconds: the runtime's constructor waits first, as a large bundle's sessions do
SLOW_LOAD = """
import time
from dspark.runtime import api
_init = api.Runtime.__init__
def _slow(self, *args, **kwargs):
    time.sleep(3)
    _init(self, *args, **kwargs)
api.Runtime.__init__ = _slow
"""


def test_sigterm_while_loading_waits_for_the_load_then_exits_0_without_starting_the_engine(tiny_bundle_v6, tmp_path):
    import subprocess
    import sys

    from serve_support import free_port

    log = tmp_path / "server.log"
    cmd = [sys.executable, "-c", SLOW_LOAD + "\nfrom dspark.cli import main_cli; main_cli()", "serve",
           str(tiny_bundle_v6[3]), "--port", str(free_port()), "--threads", "1", "--model-name", "tiny"]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: "Application startup complete" in log.read_text(), 60, 0.1), log.read_text()
        process.terminate()  # SIGTERM: the loader is inside the runtime's constructor
        assert process.wait(60) == 0, log.read_text()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "stopping once the bundle has finished loading" in text
    assert "batch slot" not in text and "ready on" not in text  # no engine started, never announced ready
    assert "Traceback" not in text
