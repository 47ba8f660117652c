"""`dspark serve` through the official openai client: tokens equal `dspark run`'s, streaming, usage, metrics."""
import json
import subprocess
import sys

import pytest

from dspark.runtime import DecodeOptions

openai = pytest.importorskip("openai")

PROMPTS = ["w1 w2 w3", "w4 w1", "w2 w2 w3 w1 w0", "w3"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def dspark_run(bundle, prompt, max_tokens, *args):
    out = subprocess.run([sys.executable, "-c", "from dspark.cli import main_cli; main_cli()", "run", str(bundle),
                          "--prompt", prompt, "--max-new-tokens", str(max_tokens), "--threads", "1", "--json",
                          *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert server.get("/health").json() == {"status": "ok"}


def test_chat_greedy_equals_dspark_run(tiny_bundle_v6, client):
    reference = dspark_run(tiny_bundle_v6[3], PROMPTS[0], 20)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                           max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == reference["text"]
    assert reply.usage.completion_tokens == len(reference["token_ids"])
    assert reply.choices[0].finish_reason == ("stop" if reference["stopped"] else "length")


def test_completions_greedy_equal_the_runtime_on_every_prompt(runtime, client):
    for prompt in PROMPTS:
        ids = runtime.tokenizer.encode(prompt)
        expected = runtime.generate([ids], DecodeOptions(max_tokens=16))[0]
        for as_ids in (False, True):
            reply = client.completions.create(model="tiny", prompt=ids if as_ids else prompt, max_tokens=16,
                                              temperature=0)
            assert reply.choices[0].text == expected.text
            assert reply.usage.prompt_tokens == len(ids)
            assert reply.usage.completion_tokens == len(expected.token_ids)


def test_seeded_sampling_through_the_server_is_reproducible(tiny_bundle_v6, client):
    reference = dspark_run(tiny_bundle_v6[3], PROMPTS[1], 24, "--temperature", "1", "--seed", "7")
    texts = {client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                                            max_tokens=24, temperature=1, seed=7).choices[0].message.content
             for _ in range(2)}
    assert texts == {reference["text"]}


def test_sampling_parameters_through_the_client_equal_the_runtime(runtime, client):
    """top_p, penalties and logit_bias (OpenAI's), top_k, min_p and repetition_penalty (vLLM's, as extra_body):
    a seeded request's tokens equal the runtime's with the same parameters; greedy with penalties too."""
    from dspark.runtime.sampling import SamplingParams

    ids = runtime.tokenizer.encode(PROMPTS[2])
    for temperature, seed in ((1.0, 3), (0.0, 0)):
        params = SamplingParams(top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                                frequency_penalty=0.3, logit_bias={2: -1.5})
        expected = runtime.generate([ids], DecodeOptions(max_tokens=16, temperature=temperature, seed=seed,
                                                         sampling=params))[0]
        plain = runtime.generate([ids], DecodeOptions(max_tokens=16, temperature=temperature, seed=seed))[0]
        assert expected.token_ids != plain.token_ids  # the parameters change this decode
        reply = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=temperature,
                                          seed=seed, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                                          logit_bias={"2": -1.5},
                                          extra_body={"top_k": 4, "min_p": 0.05, "repetition_penalty": 1.2})
        assert reply.choices[0].text == expected.text


def test_streaming_gives_the_same_text_in_pieces_and_usage(runtime, client):
    expected = runtime.generate([PROMPTS[2]], DecodeOptions(max_tokens=24, temperature=1.0, seed=3))[0]
    for chat in (True, False):
        if chat:
            stream = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=24, temperature=1,
                seed=3, stream=True, stream_options={"include_usage": True})
        else:
            stream = client.completions.create(model="tiny", prompt=runtime.tokenizer.encode_chat(PROMPTS[2]),
                                               max_tokens=24, temperature=1, seed=3, stream=True,
                                               stream_options={"include_usage": True})
        chunks = list(stream)
        pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices]
        assert "".join(pieces) == expected.text
        assert len([p for p in pieces if p]) > 1  # it did stream
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_stop_strings(runtime, client):
    expected = runtime.generate([PROMPTS[2]], DecodeOptions(max_tokens=24, temperature=1.0, seed=3))[0].text
    stop = expected.split()[2]
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[2]}],
                                           max_tokens=24, temperature=1, seed=3, stop=[stop])
    assert reply.choices[0].message.content == expected[:expected.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_metrics_count_what_was_served(server, client):
    before = server.metric("dspark_generation_tokens_total")
    requests_before = server.metric("dspark_requests_total")
    reply = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=12, temperature=0)
    assert server.metric("dspark_generation_tokens_total") - before == reply.usage.completion_tokens
    assert server.metric("dspark_requests_total") - requests_before == 1
    text = server.get("/metrics").text
    for name in ("dspark_queue_depth", "dspark_busy_slots", "dspark_time_to_first_token_seconds_bucket",
                 "dspark_inter_token_latency_seconds_bucket", "dspark_request_duration_seconds_bucket",
                 "dspark_request_tau_bucket", "dspark_verify_length_bucket", "dspark_draft_proposed_total",
                 "dspark_draft_accepted_total", "dspark_rounds_total", "dspark_kv_positions_in_use",
                 "dspark_kv_positions_capacity", "dspark_prompt_tokens_total", "dspark_ready 1.0"):
        assert name in text
    proposed = server.metric('dspark_draft_proposed_total{position="1"}')
    accepted = server.metric('dspark_draft_accepted_total{position="1"}')
    assert 0 <= accepted <= proposed and proposed > 0
    assert 1.0 <= server.metric('dspark_acceptance_length{model="tiny"}') <= 1 + 7  # the live collapse watch
    assert 0.0 <= server.metric('dspark_acceptance_position1{model="tiny"}') <= 1.0


def per_position(server, width):
    return [server.metric(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="tiny",'
                          f'position="{p}"}}', missing=0.0) for p in range(width)]


def test_vllm_names_and_the_per_request_speculative_statistics_agree(tiny_bundle_v6, server, client):
    """vLLM's metric names count what dspark's do, and each response's `metrics.speculative_decoding` (where vLLM
    puts it) adds up to what the counters moved by, streamed (in the usage chunk) or not."""
    from dspark.bundle import Manifest

    block = Manifest.read(tiny_bundle_v6[3]).block_size
    counters = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                "generation_tokens", "prompt_tokens")
    for stream in (False, True):
        before = {c: server.metric(f"vllm:{c}_total", missing=0.0) for c in counters}
        success = server.metric('vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}',
                                missing=0.0)
        positions = per_position(server, block)
        if stream:
            chunks = list(client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=24, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            last = chunks[-1].model_dump()
        else:
            last = client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=24,
                                             temperature=0).model_dump()
        spec = last["metrics"]["speculative_decoding"]
        moved = {c: server.metric(f"vllm:{c}_total") - before[c] for c in counters}
        assert spec["num_spec_tokens"] == block and len(spec["acceptance_histogram"]) == block + 1
        assert moved["spec_decode_num_drafts"] == spec["num_spec_steps"] == sum(spec["acceptance_histogram"]) > 0
        assert moved["spec_decode_num_draft_tokens"] == spec["num_draft_tokens"] >= spec["num_accepted_draft_tokens"]
        accepted = sum(j * n for j, n in enumerate(spec["acceptance_histogram"]))
        assert moved["spec_decode_num_accepted_tokens"] == spec["num_accepted_draft_tokens"] == accepted
        assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / spec["num_spec_steps"])
        assert spec["draft_acceptance_rate"] == pytest.approx(accepted / spec["num_draft_tokens"])
        at = [a - b for a, b in zip(per_position(server, block), positions)]
        assert at == [sum(spec["acceptance_histogram"][p + 1:]) for p in range(block)]
        assert moved["generation_tokens"] == last["usage"]["completion_tokens"] == 24
        assert moved["prompt_tokens"] == last["usage"]["prompt_tokens"]
        assert server.metric('vllm:request_success_total{engine="0",finished_reason="length",'
                             'model_name="tiny"}') - success == 1
    text = server.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket"):
        assert name in text, name


def test_a_request_without_temperature_decodes_greedily_and_the_folder_name_is_accepted(tiny_bundle_v6, client,
                                                                                        runtime):
    """The server's default temperature is `dspark run`'s and the Triton model's (0), so the same request gives the
    same text every time; the bundle folder's name is a model id as good as --model-name's."""
    for prompt in PROMPTS[:2]:
        expected = runtime.generate([runtime.tokenizer.encode(prompt)], DecodeOptions(max_tokens=16))[0]
        for model in ("tiny", tiny_bundle_v6[3].name):
            reply = client.completions.create(model=model, prompt=prompt, max_tokens=16)
            assert reply.choices[0].text == expected.text and reply.model == "tiny"


def test_the_server_logs_one_access_line_per_request_at_its_default_level(tiny_bundle_v6, tmp_path):
    from serve_support import start_server

    srv = start_server(tiny_bundle_v6[3], tmp_path / "server.log", "--log-level", "info")
    try:
        assert srv.get("/v1/models").status_code == 200
    finally:
        assert srv.stop() == 0
    assert '"GET /v1/models HTTP/1.1" 200' in srv.log.read_text()
