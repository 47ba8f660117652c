"""Servers for the serving tests: one `dspark serve` per test module, on 127.0.0.1."""
import pytest

from serve_support import start_server


@pytest.fixture(scope="module")
def server(tiny_bundle_v6, tmp_path_factory):
    """A server on the tiny bundle: 2 slots drafting every round (policy all), 4 queued requests at most."""
    srv = start_server(tiny_bundle_v6[3], tmp_path_factory.mktemp("serve") / "server.log",
                       "--batch-size", "2", "--policy", "all", "--max-queue", "4", "--model-name", "tiny")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]
