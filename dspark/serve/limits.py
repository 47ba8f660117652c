"""Bounds on request bodies (ASGI middleware): the body is read here, before the app sees it, and refused with 413
once it passes max_bytes, whatever its transfer encoding (a declared Content-Length over the limit: before a byte
of it is read), or with 408 when it is not all there within `timeout` seconds (a Content-Length that never
arrives, a chunked body that never ends, one dripped a byte at a time). The app then gets the body as one message,
and after it receive() as the server answers it."""
from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark.serve.responses import ApiError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except _TooLarge:  # chunked bodies declare no length: FastAPI used to turn this into a 400
            return await self._refuse(scope, receive, send)
        except TimeoutError:
            error = ApiError(408, f"the request body did not arrive within {self.timeout:g} s")
            response = error.response()
            response.headers["connection"] = "close"  # the rest of the body may still come: not a keep-alive
            return await response(scope, receive, send)
        if body is None:  # the client went away before its body was complete: nobody to answer
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None if the client disconnects first; _TooLarge once it passes max_bytes."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = ApiError(413, f"the request body is larger than {self.max_bytes} bytes")
        await error.response()(scope, receive, send)


class _TooLarge(Exception):
    pass
