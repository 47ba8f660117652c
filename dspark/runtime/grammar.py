"""Grammar-constrained decoding (response_format json_object / json_schema) with llguidance, exact under
speculative decoding.

A constrained request's rows go through the sampler graph on logits masked on the host: row j of a round allows the
tokens the request's matcher allows after the drafts of rows 0..j-1. Drafts stay the drafter's own (unconstrained):
the verified ones are checked against the matcher as proposed, and a round verifies at most up to the first draft
the grammar refuses (that draft is judged, so rejected, and its residual resampled, as rejection sampling requires;
the rows after it would never be read). The matcher walks the drafts to compute the masks, rolls back, and then
advances through the tokens the round commits. Greedy: the masked argmax at every position, token for token what
autoregressive decoding with the same mask gives; sampled: that distribution."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.errors import DSparkError
from dspark.lazy import optional_import

MAX_SCHEMA_BYTES = 64_000
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a model cannot pad it with whitespace forever


def _llguidance():
    return optional_import("llguidance", "structured outputs need it: pip install llguidance, or dspark[serve]")


class GrammarTokenizer:
    """The bundle's tokenizer as llguidance reads it, with the bundle's stop tokens as its end of sequence."""

    def __init__(self, tokenizer_json: Path, vocab: int, stop_ids: list[int]):
        llg = _llguidance()
        try:
            self.tokenizer = llg.LLTokenizer(str(tokenizer_json), n_vocab=vocab, eos_token=list(stop_ids))
        except Exception as e:  # llguidance raises ValueError / RuntimeError for a tokenizer it cannot read
            raise DSparkError(f"structured outputs cannot use this bundle's tokenizer: {str(e).splitlines()[0]}"
                              ) from None
        self.vocab = vocab

    def json_schema(self, schema) -> "Grammar":
        """A grammar for JSON values of this schema (a dict, or True / {} for any JSON object: json_object)."""
        if not isinstance(schema, dict):
            raise DSparkError("the JSON schema must be an object")
        if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
            raise DSparkError(f"the JSON schema is over {MAX_SCHEMA_BYTES} bytes")
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise DSparkError(f"the JSON schema cannot be compiled: {str(e).splitlines()[0]}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise DSparkError(f"the JSON schema cannot be compiled: {error.splitlines()[0][:300]}")
        return Grammar(grammar, self)

    def json_object(self) -> "Grammar":
        return self.json_schema({"type": "object"})


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar for one tokenizer; each request holds a matcher of its own."""

    text: str
    tokenizer: GrammarTokenizer

    def matcher(self):
        matcher = _llguidance().LLMatcher(self.tokenizer.tokenizer, self.text, log_level=0)
        if matcher.is_error():
            raise DSparkError(f"the grammar cannot be used: {matcher.get_error()[:300]}")
        return matcher


class GrammarRows:
    """Per-slot matchers (None: the slot's request is unconstrained) and the masks of a round's rows."""

    def __init__(self, batch: int, vocab: int):
        self.matchers: list = [None] * batch
        self.vocab = vocab

    def open(self, slot: int, grammar: Grammar | None) -> None:
        self.matchers[slot] = None if grammar is None else grammar.matcher()

    def move(self, src: int, dst: int) -> None:
        self.matchers[dst], self.matchers[src] = self.matchers[src], None

    def any(self, slots) -> bool:
        return any(self.matchers[int(s)] is not None for s in slots)

    def verified(self, slot: int, drafts: np.ndarray, verify_len: int) -> int:
        """Drafts worth verifying: up to and including the first one the grammar refuses."""
        matcher = self.matchers[slot]
        if matcher is None or verify_len == 0:
            return verify_len
        valid = matcher.validate_tokens([int(t) for t in drafts[:verify_len]])
        return min(verify_len, valid + 1)

    def masks(self, slot: int, drafts: np.ndarray, rows: int) -> np.ndarray | None:
        """[rows, V] allowed tokens: row j after the drafts of rows 0..j-1 (rows after a refused draft: all, never
        read); None where the grammar allows no token at all (a dead end). The matcher is left as it was."""
        matcher = self.matchers[slot]
        allowed = np.ones((rows, self.vocab), dtype=bool)
        valid = matcher.validate_tokens([int(t) for t in drafts[:rows - 1]]) if rows > 1 else 0
        for j in range(valid + 1):
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed[j] = np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)
            if not allowed[j].any():
                matcher.rollback(j)
                return None
            if j < valid:
                matcher.consume_token(int(drafts[j]))
        matcher.rollback(valid)
        return allowed

    def advance(self, slot: int, tokens: list[int], stop_ids: set[int]) -> None:
        """The tokens committed to the slot's request (a stop token ends it, and is not consumed)."""
        matcher = self.matchers[slot]
        if matcher is None:
            return
        text = [t for t in tokens if t not in stop_ids]
        if text and not matcher.consume_tokens(text):
            raise DSparkError(f"a committed token broke the grammar: {matcher.get_error()[:300]}")
