"""Bad input and faults against `dspark serve`: OpenAI-style 4xx bodies, bounded concurrency, disconnects."""
import asyncio
import json

import httpx
import pytest

from serve_support import error_of, post, wait_until

GOOD = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'{"model": "tiny", "prompt": "\xff\xfe w1"}', None),  # not UTF-8
    ({**GOOD, "max_tokens": "4"}, "max_tokens"),
    ({**GOOD, "max_tokens": 4.5}, "max_tokens"),
    ({**GOOD, "max_tokens": -3}, "max_tokens"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": 10 ** 30}, "max_tokens"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "temperature": 1e308 * 10}, "temperature"),  # json.dumps writes Infinity
    ({**GOOD, "temperature": float("nan")}, "temperature"),
    ({**GOOD, "temperature": -0.5}, "temperature"),
    ({**GOOD, "temperature": True}, "temperature"),  # pydantic's float took true as 1.0
    ({**GOOD, "temperature": "0.5"}, "temperature"),  # and text as a number
    ({**GOOD, "seed": -1}, "seed"),
    ({**GOOD, "seed": 2 ** 80}, "seed"),
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "prompt": 17}, "prompt"),
    ({**GOOD, "prompt": [1, "w2"]}, "prompt"),
    ({**GOOD, "prompt": [1, 99]}, "prompt"),  # token id beyond the vocabulary
    ({**GOOD, "prompt": "   "}, "prompt"),
    ({**GOOD, "prompt": []}, "prompt"),
    ({**GOOD, "n": 3}, "n"),  # more choices than the server's 2 slots
    ({**GOOD, "stop": ["a"] * 9}, "stop"),
    ({**GOOD, "frobnicate": True}, "frobnicate"),  # unknown fields are refused, as the OpenAI API does
    ([GOOD], None),
    ("null", None),
])
def test_bad_bodies_get_400_with_an_openai_error(server, body, param):
    error = error_of(post(server, body), 400)
    if param is not None:
        assert error["param"] is None or error["param"].split(".")[0] == param


def test_bad_chat_bodies(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4}
    for bad in ({**chat, "messages": []}, {**chat, "messages": [{"role": "robot", "content": "w1"}]},
                {**chat, "messages": [{"role": "user"}]}, {**chat, "messages": "w1"},
                {**chat, "messages": [{"role": "user", "content": ""}]}):
        error_of(post(server, bad, "/v1/chat/completions"), 400)


def test_unknown_model_is_404_and_too_long_is_400(server):
    assert error_of(post(server, {**GOOD, "model": "gpt-4"}), 404)["code"] == "model_not_found"
    error = error_of(post(server, {**GOOD, "max_tokens": 100000}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    error_of(post(server, {**GOOD, "prompt": " ".join(["w1"] * 300)}), 400)  # prompt beyond the context
    assert httpx.get(server.url + "/v1/nothing").status_code == 404


def chunked(data: bytes, size: int = 65536):
    """The body as an iterator: httpx sends it with Transfer-Encoding: chunked, no Content-Length."""
    return (data[i:i + size] for i in range(0, len(data), size))


@pytest.mark.parametrize("encoding", ["content-length", "chunked"])
def test_oversized_body_is_413_whatever_its_encoding(server, encoding):
    huge = json.dumps({**GOOD, "prompt": "w1 " * 600_000}).encode()
    error = error_of(post(server, huge if encoding == "content-length" else chunked(huge)), 413)
    assert "larger than 1048576 bytes" in error["message"] and error["type"] == "invalid_request_error"
    assert post(server, chunked(json.dumps(GOOD).encode(), 7)).status_code == 200  # a chunked body within it


def test_a_thousand_concurrent_connections_are_bounded(server):
    async def one(client):
        try:
            response = await client.post("/v1/completions", json={**GOOD, "max_tokens": 3})
            return response.status_code
        except httpx.TransportError:
            return "refused"

    async def burst():
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(1000)))

    statuses = asyncio.run(burst())
    assert set(statuses) <= {200, 429, 503, "refused"}, set(statuses)
    assert statuses.count(200) >= 1
    assert statuses.count(429) >= 1  # 2 slots + 4 queued: the rest were refused, not queued without bound
    assert server.metric('dspark_requests_total{outcome="rejected_queue_full"}') == statuses.count(429)
    assert server.process.poll() is None
    assert server.get("/health").status_code == 200
    assert post(server, GOOD).status_code == 200  # still serving
    assert wait_until(lambda: server.metric("dspark_busy_slots") == 0 and server.metric("dspark_queue_depth") == 0)


def test_client_disconnecting_mid_stream_frees_its_slot(server):
    cancelled = server.metric('dspark_requests_total{outcome="cancelled"}', missing=0.0)
    body = {**GOOD, "max_tokens": 240, "stream": True}  # greedy w3 w3 ...: no stop token before 240
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # the first tokens arrived: go away
    assert wait_until(lambda: server.metric('dspark_requests_total{outcome="cancelled"}', 0.0) == cancelled + 1)
    assert wait_until(lambda: server.metric("dspark_busy_slots") == 0)


@pytest.mark.parametrize("args, says", [(["--policy", "all", "--gate"], "SPS table"),
                                        (["--policy", "sometimes"], "policy"), (["--gate"], "policy you name"),
                                        (["--batch-size", "0"], "auto"),
                                        (["--backend", "tensorrt", "--weights", "mapped"], "ONNX Runtime only"),
                                        (["--backend", "tensorrt", "--no-spin"], "--no-spin applies to ONNX Runtime"),
                                        (["--backend", "tensorrt", "--threads", "2"], "--threads applies to ONNX")])
def test_a_server_that_cannot_start_says_why_in_one_line(tiny_bundle_v6, args, says):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "from dspark.cli import main_cli; main_cli()", "serve",
                           str(tiny_bundle_v6[3]), "--port", "0", "--log-level", "error", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors and says in errors[-1] and "Traceback" not in done.stderr


def test_a_bundle_that_fails_to_load_ends_the_server_with_one_line(tiny_bundle_v6, tmp_path):
    """A loader dying on anything but a dspark error used to leave the server up, /health 503 'loading' forever."""
    import shutil
    import subprocess
    import sys

    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_v6[3], bundle)
    (bundle / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")  # the loop never ends
    done = subprocess.run([sys.executable, "-c", "from dspark.cli import main_cli; main_cli()", "serve", str(bundle),
                           "--port", "0", "--log-level", "error"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors and "could not load" in errors[-1] and "TemplateSyntaxError" in errors[-1]
    assert "Traceback" not in done.stderr


def _serve(bundle, *args: str, timeout: float = 300):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", "from dspark.cli import main_cli; main_cli()", "serve", str(bundle),
                           "--log-level", "error", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("host, says", [("no-such-host.invalid", "is not an address this machine can listen on"),
                                        ("203.0.113.7", "is not an address of this machine"),
                                        ("", "--host is empty")])
def test_a_host_that_cannot_be_listened_on_is_one_line(tiny_bundle_v6, host, says):
    done = _serve(tiny_bundle_v6[3], "--host", host, "--port", "0")
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert errors[0].startswith("error: ") and says in errors[0], errors


def test_a_port_in_use_is_one_line(tiny_bundle_v6):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve(tiny_bundle_v6[3], "--port", str(port))
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert errors[0] == f"error: port {port} on 127.0.0.1 is in use by another program: choose another --port " \
                        f"(--port 0 takes a free one)"


def test_port_0_says_the_port_it_listens_on(tiny_bundle_v6, tmp_path):
    import re
    import signal
    import subprocess
    import sys

    log = tmp_path / "serve.log"
    process = subprocess.Popen([sys.executable, "-c", "from dspark.cli import main_cli; main_cli()", "serve",
                                str(tiny_bundle_v6[3]), "--port", "0", "--threads", "1", "--log-level", "error"],
                               stderr=log.open("w"), stdout=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: "ready on" in log.read_text() or process.poll() is not None, 120, 0.2)
        found = re.search(r"ready on http://127\.0\.0\.1:(\d+)", log.read_text())
        assert found and int(found.group(1)) != 0, log.read_text()
        assert httpx.get(f"http://127.0.0.1:{found.group(1)}/health", timeout=30).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()[-2000:]


@pytest.mark.parametrize("field, value", [
    ("top_p", 0), ("top_p", 1.5), ("top_p", "0.9"), ("top_k", -1), ("top_k", 2.5), ("min_p", 1.5), ("min_p", True),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("logit_bias", {"1": 150}),
    ("logit_bias", {"99": 1}), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", [1]),
])
def test_out_of_range_sampling_parameters_get_a_400_naming_the_field(server, field, value):
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions",
                                                   {**{k: v for k, v in GOOD.items() if k != "prompt"},
                                                    "messages": [{"role": "user", "content": "w1 w2"}]})):
        error = error_of(post(server, {**body, field: value}, path), 400)
        assert error["param"].split(".")[0] == field, error
    assert post(server, GOOD).status_code == 200  # nothing leaked into the next request
