"""Tool calls on the chat endpoint: tools into the chat template, forced calls as a grammar, and tool_calls out.

tool_choice "required" or a named function decodes under a JSON schema of {"name": ..., "arguments": <the
function's parameters>} (dspark.runtime.grammar), so the call always parses and its arguments validate; "auto"
decodes freely and reads calls the model wrote in the Hermes format that Qwen's and other templates teach
(<tool_call>{"name": ..., "arguments": ...}</tool_call>); "none" never reports a call."""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Callable

from dspark.errors import DSparkError
from dspark.files import parse_json
from dspark.runtime.grammar import Grammar, GrammarTokenizer
from dspark.serve.schemas import ChatRequest, Message

HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def template_messages(messages: list[Message]) -> list[dict]:
    """The conversation as chat templates read it: an assistant's tool_calls with their arguments as objects, a
    tool's answer with its call id."""
    out = []
    for m in messages:
        message = {"role": m.role, "content": m.text}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": parse_json(c.function.arguments, f"tool call {c.id}'s arguments")}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def template_tools(body: ChatRequest) -> list[dict] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools]


@dataclass(frozen=True)
class ToolCalls:
    """How a chat request's output becomes tool_calls: `forced` (required / named: the whole output is one call
    under a grammar) or read from Hermes-format blocks (auto)."""

    names: tuple[str, ...]
    forced: bool

    def read(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished output; no calls: (text, [])."""
        if self.forced:
            found = [text]
        else:
            found = HERMES_CALL.findall(text)
        calls = []
        for block in found:
            try:
                value = parse_json(block, "a tool call")
            except DSparkError:  # not a call after all: left as text
                continue
            if isinstance(value, dict) and value.get("name") in self.names and isinstance(value.get("arguments"),
                                                                                          dict):
                calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                              "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])}})
        if not calls:
            return text, []
        content = None if self.forced else (text[:text.find("<tool_call>")].strip() or None)
        return content, calls


def tool_calls(body: ChatRequest, grammars: Callable[[], GrammarTokenizer]) -> tuple[ToolCalls | None, Grammar | None]:
    """How the request's output is read for tool calls, and the grammar of a forced call (None: free text);
    grammars: what compiles it (called only for a forced call)."""
    if not body.tools or body.tool_choice == "none":
        return None, None
    names = tuple(t.function.name for t in body.tools)
    choice = body.tool_choice or "auto"
    if choice == "auto":
        return ToolCalls(names, forced=False), None
    if choice == "required":
        tools = body.tools
    else:
        tools = [t for t in body.tools if t.function.name == choice.function.name]
        if not tools:
            raise DSparkError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                           "arguments": t.function.parameters or {"type": "object"}},
                         "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    return ToolCalls(names, forced=True), grammars().json_schema(schema)
