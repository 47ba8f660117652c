"""Tokenizer + chat template + stop tokens from an HF-style folder, with `tokenizers` and jinja2 only (no torch)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from tokenizers import Tokenizer, decoders

from dspark.chat_template import BoundedTemplates, render_bounded
from dspark.errors import DSparkError
from dspark.files import read_json, read_text
from dspark.schema import contained, is_int


def _load_json(path: Path) -> dict:
    if not path.exists():
        return {}
    return read_json(path, kind=dict)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass
class ChatTokenizer:
    """A model folder's tokenizer and chat template. In a bundle (confined) every file must lie inside the folder
    after links are resolved; an HF folder's files may be links into the hub cache."""
    folder: Path
    confined: bool = False

    def file(self, name: str) -> Path:
        """A file of the tokenizer's folder (confined: inside it)."""
        return contained(self.folder, name) if self.confined else self.folder / name

    def __post_init__(self):
        path = self.file("tokenizer.json")
        if not path.exists():
            raise DSparkError(f"{self.folder} has no tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise DSparkError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
        self.config = _load_json(self.file("tokenizer_config.json"))
        template_file = self.file("chat_template.jinja")
        self.chat_template = read_text(template_file) if template_file.exists() else self.config.get("chat_template")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise DSparkError(f"{self.folder}: chat_template must be text, not {type(self.chat_template).__name__}")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self._template = None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """generation_config.json eos_token_id (int or list), else the tokenizer's eos token."""
        eos = _load_json(self.file("generation_config.json")).get("eos_token_id")
        if eos is None and isinstance(self.eos_token, str):
            eos = self.tok.token_to_id(self.eos_token)
        if eos is None:
            return ()
        ids = eos if isinstance(eos, list) else [eos]
        if not all(is_int(i) and i >= 0 for i in ids):
            raise DSparkError(f"{self.folder}/generation_config.json: eos_token_id {eos!r} is not token ids")
        return tuple(sorted(set(ids)))

    def render(self, prompt: str, system: str | None = None) -> str:
        if not self.chat_template:
            return prompt
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        try:
            if self._template is None:
                env = BoundedTemplates(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = _raise_exception
                self._template = env.from_string(self.chat_template)
            text = render_bounded(self._template, messages=messages, add_generation_prompt=True,
                                  enable_thinking=False, bos_token=_text_or_empty(self.bos_token),
                                  eos_token=_text_or_empty(self.eos_token))
        except DSparkError:
            raise
        except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as e:
            raise DSparkError(f"the chat template of {self.folder} failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}"[:300]) from None
        if not isinstance(text, str):
            raise DSparkError(f"the chat template of {self.folder} did not render text")
        return text

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        for what, text in (("prompt", prompt), ("system prompt", system)):
            if text is not None and not is_utf8(text):
                raise DSparkError(f"the {what} is not valid UTF-8 text")
        if not prompt.strip():
            raise DSparkError("empty prompt: give some text")
        return self.tok.encode(self.render(prompt, system), add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as OpenAI's logprobs report them: a byte-level BPE piece or a <0xNN>
        byte-fallback piece may hold part of a UTF-8 character, which decoding the token alone would lose."""
        piece = self.tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if isinstance(self.tok.decoder, decoders.ByteLevel) and all(c in BYTE_OF_CHAR for c in piece):
            return bytes(BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.tok.decode([int(token_id)], skip_special_tokens=False).encode()


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for themselves, the others
    (controls, space, 127..160, the soft hyphen) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


BYTE_OF_CHAR = _byte_level_alphabet()


def _raise_exception(msg):
    raise DSparkError(f"chat template refused the conversation: {msg}")


def _text_or_empty(value) -> str:
    return value if isinstance(value, str) else ""


def is_utf8(text: str) -> bool:
    """False for text holding lone surrogates (bytes that were not UTF-8, e.g. a command-line argument)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


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
