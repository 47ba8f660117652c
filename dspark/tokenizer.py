"""Tokenizer + chat template + stop tokens from an HF-style folder, with `tokenizers` and jinja2 only (no torch)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from dspark.errors import DSparkError


def _load_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DSparkError(f"{path} is not valid JSON ({e.msg})") from None


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass
class ChatTokenizer:
    folder: Path

    def __post_init__(self):
        path = self.folder / "tokenizer.json"
        if not path.exists():
            raise DSparkError(f"{self.folder} has no tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise DSparkError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
        self.config = _load_json(self.folder / "tokenizer_config.json")
        template_file = self.folder / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.exists() else self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self._template = None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """generation_config.json eos_token_id (int or list), else the tokenizer's eos token."""
        eos = _load_json(self.folder / "generation_config.json").get("eos_token_id")
        if eos is None and self.eos_token is not None:
            eos = self.tok.token_to_id(self.eos_token)
        if eos is None:
            return ()
        return tuple(sorted(set(eos if isinstance(eos, list) else [eos])))

    def render(self, prompt: str, system: str | None = None) -> str:
        if not self.chat_template:
            return prompt
        if self._template is None:
            def raise_exception(msg):
                raise DSparkError(f"chat template refused the conversation: {msg}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self._template.render(messages=messages, add_generation_prompt=True, enable_thinking=False,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        if not prompt.strip():
            raise DSparkError("empty prompt: give some text")
        return self.tok.encode(self.render(prompt, system), add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)


class IncrementalDetokenizer:
    """Text of a growing id list, piece by piece, decoding only a short window per step (not the whole list).

    The window starts a few tokens back (`prefix`) so that decoders which treat the first token specially (a
    leading-space marker) see the same context as a full decode; a piece is released once it no longer ends in an
    incomplete UTF-8 sequence (U+FFFD), as a full decode of the ids so far would show it.
    """

    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids up to here have been released as text

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        shown = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(shown) or text.endswith("\ufffd") or not text.startswith(shown):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown):]
