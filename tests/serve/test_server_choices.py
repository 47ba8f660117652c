"""n and best_of through the official openai client (the server has 2 batch slots): choices indexed, streamed and
not, seeded choices reproducible, best_of returns the choice of the highest log-probability per token."""
import pytest

from serve_support import error_of, post

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "w2 w2 w3 w1 w0"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_choices_streamed_and_not(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.5, seed=5, n=2)
    reply = client.chat.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1]
    texts = [c.message.content for c in reply.choices]
    assert texts[0] != texts[1]  # two samples
    assert client.chat.completions.create(**kwargs).model_dump()["choices"] == reply.model_dump()["choices"]
    pieces = {0: "", 1: ""}
    finished = set()
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert [pieces[0], pieces[1]] == texts and finished == {0, 1}
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert reply.usage.prompt_tokens < reply.usage.completion_tokens  # the prompt counted once


def test_best_of_returns_the_most_likely_choice_per_token(client):
    kwargs = dict(model="tiny", prompt="w1 w2", max_tokens=12, temperature=1.5, seed=8)
    every = client.completions.create(**kwargs, n=2, logprobs=0).choices
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every]
    best = client.completions.create(**kwargs, best_of=2)
    assert len(best.choices) == 1 and best.choices[0].index == 0 and best.choices[0].logprobs is None
    assert best.choices[0].text == every[means.index(max(means))].text
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in every)  # both were generated


@pytest.mark.parametrize("extra, param", [
    ({"n": 3}, "n"),  # more choices than the server's slots
    ({"n": 0}, "n"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"best_of": 3}, "best_of"),
])
def test_bad_choices_get_a_400_naming_the_field(server, extra, param):
    error = error_of(post(server, {"model": "tiny", "prompt": "w1", "max_tokens": 4, **extra}), 400)
    assert error["param"] == param, error
    assert post(server, {"model": "tiny", "prompt": "w1", "max_tokens": 4}).status_code == 200
