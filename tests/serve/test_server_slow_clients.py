"""Clients that go away or dawdle against a server whose requests take a while (every graph call sleeps) and
whose request timeout is 1 s."""
import http.client
import json
import select
import socket
import time

import pytest

from serve_support import SLOW_GRAPHS, start_server, wait_until

LONG = 240  # tokens: at least 240 rounds of 50 ms (one token a round with --policy ar), 12 s or more
TIMEOUT = 1.0  # --request-timeout
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def slow(tiny_bundle_v6, tmp_path_factory):
    srv = start_server(tiny_bundle_v6[3], tmp_path_factory.mktemp("slow") / "server.log", "--batch-size", "1",
                       "--policy", "ar", "--model-name", "tiny", "--request-timeout", str(TIMEOUT),
                       prelude=SLOW_GRAPHS)
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


def raw_request(port: int, body: dict, path: str = "/v1/completions") -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "w1 w2"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 w2"}]}),
    ("/v1/completions", {"prompt": "w1 w2", "stream": True}),  # streams cancelled already: kept so
])
def test_a_client_leaving_a_whole_response_frees_its_slot_at_once(slow, path, body):
    """Tokens flowing kept a non-streaming request from ever looking for its client: the slot stayed busy to the
    last token."""
    cancelled = slow.metric('dspark_requests_total{outcome="cancelled"}', missing=0.0)
    finished = slow.metric('dspark_requests_total{outcome="length"}', missing=0.0)
    sock = raw_request(slow.port, {"model": "tiny", "max_tokens": LONG, "temperature": 0, **body}, path)
    assert wait_until(lambda: slow.metric("dspark_busy_slots") == 1, 30)
    sock.close()
    # well before the 12 s the request would take: cancelled, not finished
    assert wait_until(lambda: slow.metric('dspark_requests_total{outcome="cancelled"}', 0.0) == cancelled + 1, 6)
    assert wait_until(lambda: slow.metric("dspark_busy_slots") == 0, 6)
    assert slow.metric('dspark_requests_total{outcome="length"}', missing=0.0) == finished
    assert slow.process.poll() is None


def until_closed(sock: socket.socket, bound: float = 15.0) -> bytes:
    """What the server sends before it closes the connection; socket.timeout if it is still open after `bound` s."""
    sock.settimeout(bound)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def error_408(answer: bytes) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "did not arrive within 1 s" in error["message"]
    return error


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_headers_that_never_finish_are_cut_off(slow, sent):
    """uvicorn has no header timeout: a connection that never finished its headers stayed open for good."""
    with socket.create_connection(("127.0.0.1", slow.port), timeout=10) as sock:
        sock.sendall(sent)
        answer = until_closed(sock)
    if sent:
        assert "headers" in error_408(answer)["message"]
    else:
        assert answer == b""  # nothing was asked: closed without an answer


def test_headers_dripped_a_byte_at_a_time_are_cut_off(slow):
    """The deadline is on the whole of the headers, not on the gap between bytes."""
    request = HEAD + b"X-Pad: " + b"a" * 300
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", slow.port), timeout=10) as sock:
        for byte in request:  # 0.05 s a byte: 17 s to send it all
            if select.select([sock], [], [], 0.05)[0]:
                break  # the server answered
            sock.sendall(bytes([byte]))
        answer = until_closed(sock)
    assert time.monotonic() - start < 10
    error_408(answer)


@pytest.mark.parametrize("head, part", [
    (b"Content-Length: 100\r\n", b'{"model": '),
    (b"Transfer-Encoding: chunked\r\n", b'9\r\n{"model":\r\n'),
])
def test_a_body_that_never_arrives_is_408(slow, head, part):
    with socket.create_connection(("127.0.0.1", slow.port), timeout=10) as sock:
        sock.sendall(HEAD + head + b"\r\n" + part)
        answer = until_closed(sock)
    assert "body" in error_408(answer)["message"]


def test_the_deadlines_leave_a_slow_answer_and_keep_alive_alone(slow):
    """Headers and body in time: the answer may take longer than the timeout, and the connection serves on."""
    conn = http.client.HTTPConnection("127.0.0.1", slow.port, timeout=60)
    body = json.dumps({"model": "tiny", "prompt": "w1 w2", "max_tokens": 40, "temperature": 0})  # 2 s or more
    sockets = []
    for _ in range(2):
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200 and json.loads(reply.read())["usage"]["completion_tokens"] == 40
        sockets.append(conn.sock)
    conn.close()
    assert sockets[0] is not None and sockets[1] is sockets[0]  # one connection for both
