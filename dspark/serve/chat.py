"""A conversation through the bundle's chat template (sandboxed jinja2, as dspark.tokenizer renders one prompt)."""
from __future__ import annotations

from jinja2.sandbox import ImmutableSandboxedEnvironment

from dspark.errors import DSparkError
from dspark.tokenizer import ChatTokenizer


class ChatRenderer:
    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer
        self.template = None
        if tokenizer.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = self._refuse
            self.template = env.from_string(tokenizer.chat_template)

    @staticmethod
    def _refuse(message: str):
        raise DSparkError(f"chat template refused the conversation: {message}")

    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the conversation with the assistant's turn opened (tools: the functions the model may call,
        for templates that describe them). A single user message gives the ids `dspark run --prompt` decodes."""
        if not any(m["content"].strip() or m.get("tool_calls") for m in messages):
            raise DSparkError("empty prompt: the messages hold no text")
        if self.template is None:
            text = "\n".join(m["content"] for m in messages)
        else:
            t = self.tokenizer
            extra = {"tools": tools} if tools else {}
            text = self.template.render(messages=messages, add_generation_prompt=True, enable_thinking=False,
                                        bos_token=t.bos_token or "", eos_token=t.eos_token or "", **extra)
        return self.tokenizer.encode(text)
