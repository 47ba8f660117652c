"""logprobs / top_logprobs through the official openai client: chat and completions, streamed and not, equal to the
runtime's (tests/runtime/test_logprobs.py checks those against the PyTorch target)."""
import json

import pytest

from dspark.runtime import DecodeOptions
from dspark.runtime.sampling import SamplingParams
from serve_support import error_of, post

openai = pytest.importorskip("openai")

PROMPT = "w2 w2 w3 w1 w0"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _expected(runtime, ids, top, temperature=1.0, seed=3, params=SamplingParams()):
    return runtime.generate([ids], DecodeOptions(max_tokens=16, temperature=temperature, seed=seed, logprobs=top,
                                                 sampling=params))[0]


def test_chat_logprobs_streamed_and_not_equal_the_runtimes(runtime, client):
    ids = runtime.tokenizer.encode_chat(PROMPT)
    expected = _expected(runtime, ids, 2)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=1,
                  seed=3, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    for content in (whole, streamed):
        assert len(content) == len(expected.token_ids)
        for got, want in zip(content, expected.logprobs):
            assert got.token == runtime.tokenizer.decode([want.token], skip_special=False)
            assert bytes(got.bytes).decode() == got.token
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t.logprob for t in got.top_logprobs] == pytest.approx([lp for _, lp in want.top], abs=1e-4)
            assert [t.token for t in got.top_logprobs] == [runtime.tokenizer.decode([t]) for t, _ in want.top]


def test_completion_logprobs_streamed_and_not_equal_the_runtimes(runtime, client):
    ids = runtime.tokenizer.encode(PROMPT)
    expected = _expected(runtime, ids, 3, temperature=0.0, seed=0)
    kwargs = dict(model="tiny", prompt=ids, max_tokens=16, temperature=0, logprobs=3)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    streamed = {key: [x for c in chunks if c.logprobs for x in getattr(c.logprobs, key)]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for got in (whole.logprobs.model_dump(), streamed):
        assert got["tokens"] == [runtime.tokenizer.decode([t], skip_special=False) for t in expected.token_ids]
        assert got["token_logprobs"] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
        for top, entry, token in zip(got["top_logprobs"], expected.logprobs, got["tokens"]):
            assert token in top and len(top) in (3, 4)  # the chosen token is always listed
            assert top[token] == pytest.approx(entry.logprob, abs=1e-4)
        offsets = got["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)


def test_a_token_filtered_out_is_reported_at_a_floor_in_valid_json(server, runtime):
    """top_k 2 leaves the other tokens at probability 0: their log-probability (-inf) is reported as -9999."""
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 6, "temperature": 1, "seed": 1, "top_k": 2,
            "logprobs": 4}
    reply = post(server, body, "/v1/completions")
    assert reply.status_code == 200
    logprobs = json.loads(reply.text)["choices"][0]["logprobs"]  # strict JSON: no -Infinity
    assert all(sorted(top.values())[0] == -9999.0 for top in logprobs["top_logprobs"])
    assert all(lp > -9999.0 for lp in logprobs["token_logprobs"])


def test_no_logprobs_unless_asked(client):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=4)
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
])
def test_bad_logprobs_get_a_400_naming_the_field(server, path, extra, param):
    body = {"model": "tiny", "max_tokens": 4, **extra}
    body.update({"prompt": "w1"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "w1"}]})
    error = error_of(post(server, body, path), 400)
    assert error["param"].split(".")[0] == param, error
