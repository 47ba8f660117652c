"""The OpenAI-compatible HTTP app (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics. Requests go to the always-on engine (dspark.runtime.engine); its deltas come back on the event loop
through call_soon_threadsafe. No endpoint reads or writes a file a request names."""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace
from typing import AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dspark.errors import DSparkError
from dspark.noise import GREEDY_EPS
from dspark.runtime.engine import EngineClosed, QueueFull
from dspark.runtime.engine_request import Delta, Request, RequestOptions
from dspark.runtime.logprobs import check_logprobs
from dspark.runtime.grammar import Grammar
from dspark.runtime.sampling import NEUTRAL, SamplingParams, check_sampling, runs_sampler
from dspark.serve.limits import BodyLimit
from dspark.serve.logprobs import LogprobText
from dspark.serve.responses import DONE, ApiError, Shape, sse
from dspark.serve.schemas import ChatRequest, CompletionRequest, SamplingFields
from dspark.serve.state import ServerState
from dspark.serve.tools import ToolCalls, template_messages, template_tools, tool_calls

SAMPLING_FIELDS = ("top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "logit_bias")
NEUTRAL_BODY = SamplingFields(model="")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="dspark serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(BodyLimit, max_bytes=state.config.max_body_bytes, timeout=state.config.request_timeout)
    _error_handlers(app, state)

    @app.get("/health")
    def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready.is_set():
            return JSONResponse({"status": state.load_error or "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": state.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "dspark"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        _engine(state, body)
        if isinstance(body.prompt, str):
            if not body.prompt.strip():
                raise ApiError(400, "empty prompt: give some text", param="prompt")
            prompt_ids = state.runtime.tokenizer.encode(body.prompt)
        else:
            prompt_ids = _checked_ids(state, body.prompt)
        return await _generate(state, http, body, prompt_ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HttpRequest):
        _engine(state, body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        try:
            reader, grammar = tool_calls(body, lambda: state.runtime.grammars)
        except DSparkError as e:
            raise ApiError(400, str(e), param="tool_choice" if str(e).startswith("tool_choice") else "tools") from None
        try:
            messages = template_messages(body.messages)
        except DSparkError as e:
            raise ApiError(400, str(e), param="messages") from None
        if grammar is not None and body.response_format is not None and body.response_format.type != "text":
            raise ApiError(400, "a forced tool call and response_format cannot both shape the output",
                           param="response_format")
        prompt_ids = state.chat.encode(messages, template_tools(body))
        return await _generate(state, http, body, prompt_ids, body.max_completion_tokens or body.max_tokens,
                               chat=True, grammar=grammar, tools=reader)

    return app


def _error_handlers(app: FastAPI, state: ServerState) -> None:
    def invalid(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
        state.metrics.requests.labels("invalid").inc()
        return ApiError(status, message, param=param).response()

    @app.exception_handler(ApiError)
    async def api_error(_, error: ApiError):
        if error.status < 500 and error.status != 429:
            state.metrics.requests.labels("invalid").inc()
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return invalid("the body is not valid JSON")
        if first.get("type") == "extra_forbidden":
            return invalid(f"Unrecognized request argument supplied: {'.'.join(loc)}", param=".".join(loc))
        return invalid(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}", param=".".join(loc) or None)

    @app.exception_handler(DSparkError)
    async def dspark_error(_, error: DSparkError):
        return invalid(str(error))

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return ApiError(error.status_code, str(error.detail), kind).response()


def _engine(state: ServerState, body: SamplingFields):
    if state.draining:
        raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
    if not state.ready.is_set():
        raise ApiError(503, "the model is still loading", "server_error", code="loading")
    if body.model != state.config.model_name and body.model not in state.config.aliases:
        raise ApiError(404, f"The model `{body.model}` does not exist (this server serves "
                            f"`{state.config.model_name}`)", param="model", code="model_not_found")
    return state.engine


def _checked_ids(state: ServerState, ids: list[int]) -> list[int]:
    vocab = state.runtime.manifest.target["vocab_size"]
    if not ids or any(not 0 <= t < vocab for t in ids):
        raise ApiError(400, f"prompt token ids must be a non-empty list of ids in 0..{vocab - 1}", param="prompt")
    return ids


def _options(state: ServerState, body: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
             grammar: Grammar | None = None):
    room = state.engine.max_tokens_for(len(prompt_ids))
    if room < 1:
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) leaves no room in the context of "
                            f"{state.engine.capacity} positions", param="messages", code="context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"max_tokens {max_tokens} is too large: the prompt has {len(prompt_ids)} tokens and "
                            f"the context {state.engine.capacity} positions (at most {room})",
                       param="max_tokens", code="context_length_exceeded")
    seed = body.seed if body.seed is not None else secrets.randbelow(2 ** 63)
    sampling = _sampling(state, body)
    options = RequestOptions(max_tokens=max_tokens or room, temperature=float(body.temperature), seed=seed,
                             stop=body.stop_strings, policy=None if body.policy == "default" else body.policy,
                             sampling=sampling, logprobs=body.top_logprobs_wanted,
                             grammar=grammar or _grammar(state, body))
    if options.logprobs is not None:
        _logprobs_ok(state, options, "logprobs")
    return options


def _sampling(state: ServerState, body: SamplingFields) -> SamplingParams:
    """The request's sampling parameters (ranges checked by the schema); 400 naming the field for a logit_bias key
    that is no token id of this model, or parameters this bundle cannot sample with."""
    vocab = state.runtime.manifest.target["vocab_size"]
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdecimal() or int(key) >= vocab:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id of this model (0..{vocab - 1})",
                           param="logit_bias")
        bias[int(key)] = float(value)
    params = SamplingParams(top_k=body.top_k, top_p=float(body.top_p), min_p=float(body.min_p),
                            repetition_penalty=float(body.repetition_penalty),
                            presence_penalty=float(body.presence_penalty),
                            frequency_penalty=float(body.frequency_penalty), logit_bias=bias)
    try:
        check_sampling(state.engine.slots.sampling, params, state.runtime.backend.kind)
    except DSparkError as e:
        first = next((name for name in SAMPLING_FIELDS if getattr(body, name) != getattr(NEUTRAL_BODY, name)), None)
        raise ApiError(400, str(e), param=first) from None
    return params


def _grammar(state: ServerState, body: SamplingFields) -> Grammar | None:
    """response_format as a grammar (None: free text); 400 naming it for a schema the grammar engine cannot
    compile, or a bundle that cannot decode under one."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.json_schema is None):
        raise ApiError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    try:
        check_sampling(state.engine.slots.sampling, NEUTRAL, state.runtime.backend.kind, constrained=True)
        grammars = state.runtime.grammars
        if fmt.type == "json_object":
            return grammars.json_object()
        return grammars.json_schema(fmt.json_schema.json_schema)
    except DSparkError as e:
        raise ApiError(400, str(e), param="response_format") from None


async def _generate(state: ServerState, http: HttpRequest, body: SamplingFields, prompt_ids: list[int],
                    max_tokens: int | None, chat: bool, grammar: Grammar | None = None, tools: ToolCalls | None = None):
    options = _options(state, body, prompt_ids, max_tokens, grammar)
    n, best_of = body.n, getattr(body, "best_of", None) or body.n
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > state.engine.batch:
        raise ApiError(400, f"{'best_of' if best_of > n else 'n'} ({best_of}) is more than this server's "
                            f"{state.engine.batch} batch slots (each choice decodes in a slot of its own)",
                       param="best_of" if best_of > n else "n")
    if best_of > n and body.stream:
        raise ApiError(400, "best_of greater than n cannot be streamed", param="best_of")
    if best_of > n and options.logprobs is None:  # the best are ranked by their log-probability per token
        _logprobs_ok(state, options, "best_of")
        options = replace(options, logprobs=0)
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue[tuple[int, Delta] | None] = asyncio.Queue()  # None: the client went away
    sinks = [lambda delta, i=i: loop.call_soon_threadsafe(deltas.put_nowait, (i, delta)) for i in range(best_of)]
    try:
        requests = state.engine.submit_choices(prompt_ids, options, best_of, sinks)
    except QueueFull as e:
        raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
    except EngineClosed as e:
        raise ApiError(503, str(e), "server_error", code="shutting_down") from None
    logprobs = None if body.top_logprobs_wanted is None else [LogprobText(state.runtime.tokenizer, chat)
                                                               for _ in range(best_of)]
    shape = Shape.new(chat, state.config.model_name, requests, state.metrics.block_size, logprobs, tools)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_events(requests, deltas, shape, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(http, requests, deltas, shape, n)


def _logprobs_ok(state: ServerState, options: RequestOptions, param: str) -> None:
    """400 naming `param` unless the backend gives log-probabilities for a request with these options."""
    try:
        check_logprobs(state.runtime.backend, runs_sampler(options.sampling, options.temperature < GREEDY_EPS,
                                                           options.grammar is not None))
    except DSparkError as e:
        raise ApiError(400, str(e), param=param) from None


async def _whole(http: HttpRequest, requests: list[Request], deltas: asyncio.Queue, shape: Shape, n: int):
    """The whole response: the n choices of the highest log-probability per token among the requests (best_of),
    else every request's."""
    watcher = asyncio.create_task(_cancel_when_gone(http, requests, deltas))
    try:
        while not all(r.done for r in requests):
            if await deltas.get() is None:  # the client went away: nobody reads this response
                return Response(status_code=499)
    finally:
        watcher.cancel()
        for request in requests:
            request.cancel()  # a no-op once finished; frees the slot when the handler is torn down
    if any(r.finish_reason == "cancelled" for r in requests):
        raise ApiError(503, "the request was cancelled: the server is shutting down", "server_error",
                       code="shutting_down")
    failed = next((r for r in requests if r.finish_reason == "error"), None)
    if failed is not None:
        raise ApiError(500, f"decoding failed: {failed.error}", "server_error")
    if len(requests) == n:
        return shape.full(requests)
    best = sorted(requests, key=lambda r: -sum(e.logprob for e in r.logprobs) / max(len(r.logprobs), 1))[:n]
    return shape.full(best, index=list(range(n)), counted=requests)


async def _cancel_when_gone(http: HttpRequest, requests: list[Request], deltas: asyncio.Queue) -> None:
    """Watch the connection while the engine works (a poll between deltas never comes while tokens flow): once the
    body is read, receive() answers only when the client disconnects."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    for request in requests:
        request.cancel()
    deltas.put_nowait(None)


async def _events(requests: list[Request], deltas: asyncio.Queue, shape: Shape, include_usage: bool
                  ) -> AsyncIterator[str]:
    """Server-sent events, the choices' chunks as they come; a client that goes away cancels the generator, which
    cancels the requests."""
    try:
        if shape.chat:
            for i in range(len(requests)):
                yield shape.chunk("", first=True, index=i)
        finished = 0
        while finished < len(requests):
            i, delta = await deltas.get()
            if delta.finish_reason in ("cancelled", "error"):
                error = ApiError(503 if delta.finish_reason == "cancelled" else 500,
                                 delta.error or "the request was cancelled: the server is shutting down",
                                 "server_error")
                yield sse(error.body())
                break
            if shape.tools is not None:  # the output is read for tool calls once whole
                if delta.finish_reason:
                    yield shape.final_chunk(requests[i], i)
            elif delta.text or delta.finish_reason:
                yield shape.chunk(delta.text, delta.finish_reason, logprobs=delta.logprobs, index=i)
            finished += bool(delta.finish_reason)
        else:
            if include_usage:
                yield shape.usage_chunk(requests)
        yield DONE
    finally:
        for request in requests:
            request.cancel()
