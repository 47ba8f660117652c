"""OpenAI-shaped bodies: errors, completions, chat completions, their stream chunks and usage."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from dspark.runtime.engine_request import Request
from dspark.runtime.logprobs import TokenLogprob
from dspark.serve.logprobs import LogprobText


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


def speculative_decoding(request: Request, block_size: int) -> dict:
    """The request's speculative decoding as vLLM reports it per request (its response's
    `metrics.speculative_decoding`): the rounds that verified drafts ("spec steps"), the drafts they verified and
    accepted, and `acceptance_histogram[j]`: steps that accepted exactly j drafts. dspark verifies a varying number
    of drafts per round (at most the block size, `num_spec_tokens`); rounds without drafts are not steps."""
    steps = [(verified, accepted) for verified, accepted in zip(request.proposed, request.accepted) if verified]
    drafts = sum(verified for verified, _ in steps)
    accepted = sum(a for _, a in steps)
    histogram = [0] * (block_size + 1)
    for _, a in steps:
        histogram[a] += 1
    return {"mean_acceptance_length": 1 + accepted / len(steps) if steps else 1.0,
            "draft_acceptance_rate": accepted / drafts if drafts else 0.0, "acceptance_histogram": histogram,
            "num_spec_steps": len(steps), "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafts,
            "num_spec_tokens": block_size}


@dataclass
class Shape:
    """How one endpoint words its bodies: text completions or chat completions."""

    chat: bool
    model: str
    request_id: str
    created: int
    block_size: int  # the bundle's: the most drafts a round verifies
    logprobs: LogprobText | None = None  # where the request asked for logprobs

    @classmethod
    def new(cls, chat: bool, model: str, request: Request, block_size: int,
            logprobs: LogprobText | None = None) -> "Shape":
        return cls(chat, model, f"{'chatcmpl' if chat else 'cmpl'}-{request.id}", int(time.time()), block_size,
                   logprobs)

    def _tail(self, request: Request) -> dict:
        """What closes a response: usage, and the speculative statistics where vLLM puts them."""
        return {"usage": usage(request),
                "metrics": {"speculative_decoding": speculative_decoding(request, self.block_size)}}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def full(self, request: Request) -> dict:
        choice = {"index": 0, "finish_reason": request.finish_reason,
                  "logprobs": self.logprobs and self.logprobs.body(request.logprobs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": request.text}
        else:
            choice["text"] = request.text
        return {**self._head(False), "choices": [choice], **self._tail(request)}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False,
              logprobs: list[TokenLogprob] = ()) -> str:
        choice = {"index": 0, "finish_reason": finish_reason,
                  "logprobs": self.logprobs.body(logprobs) if self.logprobs and logprobs else None}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["text"] = text
        return sse({**self._head(True), "choices": [choice]})

    def usage_chunk(self, request: Request) -> str:
        return sse({**self._head(True), "choices": [], **self._tail(request)})


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
