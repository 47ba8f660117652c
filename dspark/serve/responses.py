"""OpenAI-shaped bodies: errors, completions, chat completions, their stream chunks and usage."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from dspark.runtime.engine_request import Request
from dspark.runtime.logprobs import TokenLogprob
from dspark.serve.logprobs import LogprobText
from dspark.serve.tools import ToolCalls


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


def usage(requests: list[Request]) -> dict:
    """One prompt, the tokens of every choice."""
    prompt, generated = len(requests[0].prompt_ids), sum(len(r.token_ids) for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def speculative_decoding(requests: list[Request], block_size: int) -> dict:
    """The request's speculative decoding as vLLM reports it per request (its response's
    `metrics.speculative_decoding`), over its choices: the rounds that verified drafts ("spec steps"), the drafts
    they verified and accepted, and `acceptance_histogram[j]`: steps that accepted exactly j drafts. dspark verifies
    a varying number of drafts per round (at most the block size, `num_spec_tokens`); rounds without drafts are not
    steps."""
    steps = [(verified, accepted) for r in requests for verified, accepted in zip(r.proposed, r.accepted)
             if verified]
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
    """How one endpoint words its bodies: text completions or chat completions, of one or several choices."""

    chat: bool
    model: str
    request_id: str
    created: int
    block_size: int  # the bundle's: the most drafts a round verifies
    logprobs: list[LogprobText] | None = None  # one per choice, where the request asked for logprobs
    tools: ToolCalls | None = None  # a chat request with tools: its output is read for tool calls

    @classmethod
    def new(cls, chat: bool, model: str, requests: list[Request], block_size: int,
            logprobs: list[LogprobText] | None = None, tools: ToolCalls | None = None) -> "Shape":
        return cls(chat, model, f"{'chatcmpl' if chat else 'cmpl'}-{requests[0].id}", int(time.time()),
                   block_size, logprobs, tools)

    def _tail(self, requests: list[Request]) -> dict:
        """What closes a response: usage, and the speculative statistics where vLLM puts them."""
        return {"usage": usage(requests),
                "metrics": {"speculative_decoding": speculative_decoding(requests, self.block_size)}}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def full(self, requests: list[Request], index: list[int] | None = None,
             counted: list[Request] | None = None) -> dict:
        """The whole response; index: each request's choice index (default: its position); counted: the requests
        usage counts (default: these; best_of counts every request it chose from)."""
        choices = []
        for i, request in zip(index or range(len(requests)), requests):
            text = self.logprobs[request.choice] if self.logprobs else None
            choice = {"index": i, "finish_reason": request.finish_reason,
                      "logprobs": text and text.body(request.logprobs)}
            if self.chat:
                content, calls = self._read(request)
                choice["message"] = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
                choice["finish_reason"] = "tool_calls" if calls else request.finish_reason
            else:
                choice["text"] = request.text
            choices.append(choice)
        return {**self._head(False), "choices": choices, **self._tail(counted or requests)}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False,
              logprobs: list[TokenLogprob] = (), index: int = 0) -> str:
        choice = {"index": index, "finish_reason": finish_reason,
                  "logprobs": self.logprobs[index].body(logprobs) if self.logprobs and logprobs else None}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["text"] = text
        return sse({**self._head(True), "choices": [choice]})

    def _read(self, request: Request) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished chat choice."""
        if self.tools is None or request.finish_reason != "stop":
            return request.text, []
        return self.tools.read(request.text)

    def final_chunk(self, request: Request, index: int) -> str:
        """A chat choice read for tool calls, in one chunk once finished: its content or its calls."""
        content, calls = self._read(request)
        delta = {"role": "assistant"} | ({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]} if calls
                                         else {"content": content})
        choice = {"index": index, "delta": delta, "logprobs": None,
                  "finish_reason": "tool_calls" if calls else request.finish_reason}
        return sse({**self._head(True), "choices": [choice]})

    def usage_chunk(self, requests: list[Request]) -> str:
        return sse({**self._head(True), "choices": [], **self._tail(requests)})


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
