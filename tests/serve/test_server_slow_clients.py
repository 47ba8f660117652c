"""Clients that go away or dawdle against a server whose requests take a while (every graph call sleeps)."""
import json
import socket

import pytest

from serve_support import SLOW_GRAPHS, start_server, wait_until

LONG = 240  # tokens: at least 240 rounds of 50 ms (one token a round with --policy ar), 12 s or more


@pytest.fixture(scope="module")
def slow(tiny_bundle_v6, tmp_path_factory):
    srv = start_server(tiny_bundle_v6[3], tmp_path_factory.mktemp("slow") / "server.log", "--batch-size", "1",
                       "--policy", "ar", "--model-name", "tiny", prelude=SLOW_GRAPHS)
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
