"""OpenAI-shaped bodies: errors, completions, chat completions, their stream chunks and usage."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from dspark.runtime.engine_request import Request


class ApiError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def usage(request: Request) -> dict:
    prompt, generated = len(request.prompt_ids), len(request.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


@dataclass
class Shape:
    """How one endpoint words its bodies: text completions or chat completions."""

    chat: bool
    model: str
    request_id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str, request: Request) -> "Shape":
        return cls(chat, model, f"{'chatcmpl' if chat else 'cmpl'}-{request.id}", int(time.time()))

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def full(self, request: Request) -> dict:
        choice = {"index": 0, "finish_reason": request.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": request.text}
        else:
            choice["text"] = request.text
        return {**self._head(False), "choices": [choice], "usage": usage(request)}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> str:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["text"] = text
        return sse({**self._head(True), "choices": [choice]})

    def usage_chunk(self, request: Request) -> str:
        return sse({**self._head(True), "choices": [], "usage": usage(request)})


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
