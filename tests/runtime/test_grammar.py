"""Structured outputs (response_format) under speculative decoding, on a tiny random pair with a byte-level
tokenizer: greedy DSpark equals AR with the same mask token for token, sampled DSpark is distributed as AR with the
mask (two-sample chi-square, with a negative control), every finished output parses and validates (jsonschema over
many schemas and seeds), bad schemas are refused in one line, and a grammar's dead end fails its request alone."""
from __future__ import annotations

import json
from collections import Counter

import jsonschema
import numpy as np
import pytest
from scipy.stats import chi2_contingency

from dspark.errors import DSparkError
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.engine import Engine, EngineOptions
from dspark.runtime.engine_request import RequestOptions

PROMPTS = [[10, 20, 30], [65, 66, 67, 68], [123, 34]]

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "yy", "z"]}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3, "pattern": "^[a-c]*$"},
                                      "t": {"type": "null"}}, "required": ["s", "t"], "additionalProperties": False},
    {"enum": [1, 22, "abc", True, None]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "integer", "maximum": 9,
                                                                                    "minimum": 0}},
                                            "required": ["q"], "additionalProperties": False}},
     "required": ["p"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def byte_bundle(tmp_path_factory):
    from support.tiny import tiny_bundle

    return tiny_bundle(tmp_path_factory.mktemp("bytes") / "bundle", family="llama", layers=2, block_size=3, seed=5,
                       byte_tokens=True)


@pytest.fixture(scope="module")
def rt(byte_bundle):
    runtime = Runtime(byte_bundle[3])
    yield runtime
    runtime.close()


def _decode(rt, prompts, **options):
    decoder = rt.decoder(prompts, DecodeOptions(**options))
    decoder.slots.prefill_tokens = 1 << 20  # the same prompt many times: one prefill call per wave
    for _ in decoder:
        pass
    return decoder.results


def _parsed(rt, result, schema) -> bool:
    """Whether a finished output is one JSON value that the schema validates (False: cut by max_tokens)."""
    if not result.stopped:
        return False
    value = json.loads(rt.tokenizer.decode(result.token_ids))
    jsonschema.validate(value, schema)
    return True


def test_greedy_constrained_dspark_equals_autoregressive_decoding(rt):
    for schema in SCHEMAS:
        grammar = rt.grammars.json_schema(schema)
        spec = _decode(rt, PROMPTS, max_tokens=48, policy="all", grammar=grammar)
        ar = _decode(rt, PROMPTS, max_tokens=48, policy="ar", grammar=grammar)
        assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
        assert all(_parsed(rt, r, schema) for r in spec)


def test_sampled_outputs_always_parse_and_validate(rt):
    finished = 0
    for schema in SCHEMAS:
        grammar = rt.grammars.json_schema(schema)
        for seed in range(4):
            for r in _decode(rt, PROMPTS * 4, max_tokens=48, temperature=1.5, seed=seed, grammar=grammar):
                finished += _parsed(rt, r, schema)
    assert finished > 0.9 * len(SCHEMAS) * 4 * len(PROMPTS) * 4


def _two_sample_pvalue(a: list, b: list, min_count: int = 10) -> float:
    """Chi-square test that two samples come from one distribution (rare cells pooled)."""
    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb), key=str)
    common = [k for k in keys if ca[k] + cb[k] >= min_count]
    table = [[ca[k] for k in common] + [sum(ca[k] for k in keys if k not in common)],
             [cb[k] for k in common] + [sum(cb[k] for k in keys if k not in common)]]
    table = np.array([[x for x, y in zip(*table) if x + y > 0], [y for x, y in zip(*table) if x + y > 0]])
    return float(chi2_contingency(table)[1])


def test_sampled_constrained_dspark_is_distributed_as_masked_autoregressive_sampling(rt):
    """A string of letters: after its forced opening quote, 27 tokens are allowed at each position, so the random
    drafter's drafts are valid (and then mostly accepted) about a tenth of the time; DSpark's tokens against AR's
    with the same mask, position by position and as pairs, and a negative control (AR under another mask)."""
    def letters(pattern: str):
        return rt.grammars.json_schema({"type": "string", "maxLength": 6, "pattern": pattern})

    def sample(grammar, policy: str, seed: int) -> list[tuple[int, ...]]:
        results = _decode(rt, [PROMPTS[0]] * 3000, max_tokens=4, temperature=2.0, seed=seed, batch_size=1500,
                          policy=policy, grammar=grammar)
        if policy == "all":
            assert np.mean([a for r in results for a in r.accepted]) > 0.04  # drafts accepted under the mask
        return [tuple(r.token_ids) for r in results]

    spec, ar = sample(letters("^[a-z]*$"), "all", 1), sample(letters("^[a-z]*$"), "ar", 2)
    for position in (1, 2, 3):
        assert _two_sample_pvalue([s[position:position + 1] for s in spec],
                                  [s[position:position + 1] for s in ar]) > 1e-3
    assert _two_sample_pvalue([s[1:3] for s in spec], [s[1:3] for s in ar]) > 1e-3
    common = next(chr(t) for t, _ in Counter(s[1] for s in spec).most_common() if chr(t).isalpha())  # ids: bytes
    others = "".join(c for c in "abcdefghijklmnopqrstuvwxyz" if c != common)
    other = sample(letters(f"^[{others}]*$"), "ar", 3)  # a mask the samples were not drawn under
    assert _two_sample_pvalue([s[1:2] for s in spec], [s[1:2] for s in other]) < 1e-6


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": 5, "maximum": 3}, "Unsatisfiable"),
    ({"type": "strange"}, "cannot be compiled"),
    ([1, 2], "must be an object"),
])
def test_a_schema_the_engine_cannot_compile_is_refused_in_one_line(rt, schema, message):
    with pytest.raises(DSparkError, match=message):
        rt.grammars.json_schema(schema)


def test_a_dead_end_fails_its_request_alone(rt, monkeypatch):
    """A grammar that allows no token (stood in for by masks() finding none) ends its request with an error; the
    request beside it decodes to its end."""
    from dspark.runtime.grammar import GrammarRows

    grammar = rt.grammars.json_schema(SCHEMAS[1])
    monkeypatch.setattr(GrammarRows, "masks", lambda self, slot, drafts, rows: None)
    engine = Engine(rt, EngineOptions(batch_size=2, policy="all")).start()
    try:
        stuck = engine.submit(PROMPTS[0], RequestOptions(max_tokens=20, grammar=grammar))
        free = engine.submit(PROMPTS[1], RequestOptions(max_tokens=20))
        assert stuck.wait().finish_reason == "error" and "grammar allows no token" in stuck.error
        assert free.wait().finish_reason == "length" and len(free.token_ids) == 20
    finally:
        engine.close()
