"""A deadline on a request's headers: uvicorn's h11 protocol has none (its keep-alive timer starts only once a
response is complete), so a client that opens a connection and never finishes its headers, or drips them a byte at
a time (slowloris), held the connection forever. The body's deadline is the app's (dspark.serve.limits)."""
from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dspark.serve.responses import ApiError


class HeaderDeadline(H11Protocol):
    """Each request's headers must arrive within `header_timeout` seconds of the connection opening or of the
    previous response ending; past it the client gets a 408 (if it sent part of a request) and the connection
    closes. An idle keep-alive connection still closes first at uvicorn's timeout_keep_alive."""

    def __init__(self, *args, header_timeout: float = 30.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # before uvicorn starts the next request: the deadline is met once a new cycle begins
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire, self.cycle)

    def _expire(self, cycle_then) -> None:
        if self.cycle is not cycle_then or self.transport.is_closing():
            return  # the next request's headers came in time (or the connection is gone)
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(timeout_response(f"the request's headers did not arrive within "
                                                  f"{self.header_timeout:g} s"))
        self.transport.close()


def timeout_response(message: str) -> bytes:
    """A whole HTTP/1.1 408 with the server's error body, written as bytes (no request was parsed to answer)."""
    body = json.dumps(ApiError(408, message).body()).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(body)) + body
