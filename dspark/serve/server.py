"""`dspark serve`: uvicorn running the app, the bundle loaded in the background (/health says when it is ready),
and a graceful SIGTERM/SIGINT: stop admitting, let in-flight requests finish for the grace period, cancel what
is left (each such client gets an error), then exit 0."""
from __future__ import annotations

import asyncio
import errno
import socket
import sys
import threading
from contextlib import asynccontextmanager
from functools import partial

import uvicorn

from dspark.errors import DSparkError, first_line
from dspark.serve.app import create_app
from dspark.serve.deadlines import HeaderDeadline
from dspark.serve.state import ServeConfig, ServerState


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drainer is None:  # first signal: drain in the background, then let uvicorn shut down
            self._drainer = threading.Thread(target=self._drain_then_exit, daemon=True)
            self._drainer.start()
        else:  # a second signal: stop now
            super().handle_exit(sig, frame)

    def _drain_then_exit(self) -> None:
        self.state.drain()
        self.should_exit = True


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), made here rather than by uvicorn, so that a host that does
    not resolve or a port in use is one DSparkError line before anything loads (uvicorn logs those and exits 1)."""
    if not host.strip():
        raise DSparkError("--host is empty: give an address to listen on (127.0.0.1; 0.0.0.0 for every interface)")
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError, ValueError) as e:  # gaierror, an IDNA label too long, a NUL in the name
        why = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e) or type(e).__name__
        raise DSparkError(f"--host {host!r:.80} is not an address this machine can listen on ({why}): give an IP "
                          f"address or a name that resolves (127.0.0.1 by default)") from None
    errors: list[OSError] = []
    for family, kind, proto, _, address in found:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
            sock.bind(address)
            sock.set_inheritable(True)
            return sock
        except OSError as e:
            sock.close()
            errors.append(e)
    e = errors[0] if errors else OSError(errno.EADDRNOTAVAIL, "no address")
    if e.errno == errno.EADDRINUSE:
        raise DSparkError(f"port {port} on {host} is in use by another program: choose another --port (--port 0 "
                          f"takes a free one)")
    if e.errno == errno.EACCES:
        raise DSparkError(f"not allowed to listen on port {port} of {host} (ports below 1024 need privileges): "
                          f"choose --port 1024 or above")
    if e.errno == errno.EADDRNOTAVAIL:
        raise DSparkError(f"--host {host} is not an address of this machine: give one of its addresses "
                          f"(127.0.0.1; 0.0.0.0 for every interface)")
    raise DSparkError(f"cannot listen on {host}:{port}: {e.strerror or e}")


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def serve(config: ServeConfig, host: str, port: int, log_level: str = "info", access_log: bool = True) -> None:
    state = ServerState(config)
    server: DrainingServer | None = None
    sock = listening_socket(host, port)
    url = url_of(sock)

    def load() -> None:
        try:
            state.load(say=lambda line: print(f"dspark serve: {line}", file=sys.stderr, flush=True))
            if not state.ready.is_set():  # stopped while loading
                return
            also = f" (also accepted: {', '.join(config.aliases)})" if config.aliases else ""
            print(f"dspark serve: {config.model_name} ready on {url}{also}", file=sys.stderr, flush=True)
        except DSparkError:  # state.load_error holds it: serve() raises it once uvicorn has stopped
            server.should_exit = True
        except Exception as e:  # a loader that dies must not leave a server answering 503 forever
            first = first_line(e)
            state.load_error = f"could not load {config.bundle}: {type(e).__name__}{': ' + first if first else ''}"
            server.should_exit = True

    loader = threading.Thread(target=load, name="dspark-load", daemon=True)

    @asynccontextmanager
    async def lifespan(_app):
        loader.start()
        yield
        if loader.is_alive():  # a session being created cannot be interrupted; exiting under it aborts natively
            print("dspark serve: stopping once the bundle has finished loading", file=sys.stderr, flush=True)
            await asyncio.to_thread(loader.join)
        state.close()

    app = create_app(state)
    app.router.lifespan_context = lifespan
    # uvicorn answers 503 beyond max_connections open connections; within them the engine's queue answers 429
    # h11 with a deadline on each request's headers (uvicorn has none); h11 itself bounds them to 16 KiB (400)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                               http=partial(HeaderDeadline, header_timeout=config.request_timeout),
                               limit_concurrency=config.max_connections,
                               timeout_graceful_shutdown=int(config.grace) + 5, timeout_keep_alive=5)
    server = DrainingServer(uv_config, state)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if state.load_error is not None:
        raise DSparkError(state.load_error)
