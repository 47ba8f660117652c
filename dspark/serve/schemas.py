"""Request bodies of the OpenAI-compatible endpoints (pydantic), strict about types.

Unknown fields are refused with 400 (as the OpenAI API does: "Unrecognized request argument"). Sampling takes
OpenAI's top_p, presence_penalty, frequency_penalty and logit_bias and vLLM's top_k, min_p and repetition_penalty, in
their ranges (dspark.runtime.sampling). OpenAI fields this server does not implement are accepted only at their
neutral values (no echo), so a client never gets silently different sampling than it asked for.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from dspark.runtime.engine_request import MAX_STOP_CHARS, MAX_STOP_STRINGS
from dspark.runtime.logprobs import MAX_TOP_LOGPROBS
from dspark.runtime.sampling import BIAS_LIMIT, MAX_REPETITION, PENALTY_LIMIT

MAX_PROMPT_CHARS = 200_000
MAX_PROMPT_IDS = 65_536
MAX_CHOICES = 128  # n and best_of
MAX_TOOLS = 128
MAX_BIASED = 1024  # logit_bias entries (OpenAI takes up to 300)

Number = Annotated[float, Field(allow_inf_nan=False)]
Stop = Union[None, Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)],
             Annotated[list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                       Field(max_length=MAX_STOP_STRINGS)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[StrictStr, Field(max_length=64)]
    description: StrictStr | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # dspark always decodes to the schema (what strict asks for)


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema (values of a schema)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] = 0.0  # greedy, as `dspark run` and the Triton model
    seed: Annotated[StrictInt, Field(ge=0, lt=2 ** 63)] | None = None
    stop: Stop = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    policy: Literal["ar", "default"] = "default"  # dspark: decode this request autoregressively
    user: Annotated[StrictStr, Field(max_length=256)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1  # at most the server's batch slots (the app checks)
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0  # vLLM's; 0: off
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] = 0.0  # vLLM's
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=MAX_REPETITION)] = 1.0  # vLLM's
    presence_penalty: Annotated[Number, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] = 0.0
    logit_bias: Annotated[dict[StrictStr, Annotated[Number, Field(ge=-BIAS_LIMIT, le=BIAS_LIMIT)]],
                          Field(max_length=MAX_BIASED)] | None = None
    response_format: ResponseFormat | None = None

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     mode="before")
    @classmethod
    def _a_number(cls, value):
        """A JSON number: pydantic's float would take true and "0.5" (a client's bug, not a temperature)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"Input should be a number, not {type(value).__name__}")
        return value

    @property
    def top_logprobs_wanted(self) -> int | None:
        """None: no logprobs; else the most likely alternatives each token's entry lists."""
        return None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    prompt: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[
        list[StrictInt], Field(max_length=MAX_PROMPT_IDS)]
    echo: Literal[False] = False
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None  # default: n
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16  # the OpenAI default for completions
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # top alternatives per token

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


ToolName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ToolName
    arguments: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)]  # JSON text, as the API sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Annotated[StrictStr, Field(max_length=256)]
    type: Literal["function"]
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: Annotated[StrictStr, Field(max_length=256)] | None = None  # a tool's answer to that call

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ToolName
    description: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: StrictBool | None = None  # dspark always decodes a forced call to the schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ToolName


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1, max_length=256)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: StrictBool | None = None  # a forced call is one call
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, messages: list[Message]) -> list[Message]:
        if messages[-1].role == "assistant":
            raise ValueError("the last message must not be the assistant's (continuing it is not supported)")
        return messages
