"""response_format through the official openai client, on a tiny pair with a byte-level tokenizer (so JSON can be
written): outputs parse and validate, equal the runtime's under the same grammar, streamed or not; schemas the
grammar engine cannot compile get a 400 naming response_format."""
import json

import jsonschema
import pytest

from dspark.runtime import DecodeOptions, Runtime
from serve_support import error_of, post, start_server

openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from support.tiny import tiny_bundle

    return tiny_bundle(tmp_path_factory.mktemp("bytes") / "bundle", family="llama", layers=2, block_size=3, seed=5,
                       byte_tokens=True)[3]


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    srv = start_server(bundle, tmp_path_factory.mktemp("serve") / "server.log", "--batch-size", "2", "--policy",
                       "all", "--model-name", "tiny")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_outputs_validate_and_equal_the_runtime(bundle, client):
    with Runtime(bundle) as rt:
        ids = rt.tokenizer.encode("ab")
        expected = rt.generate([ids], DecodeOptions(max_tokens=40, grammar=rt.grammars.json_schema(SCHEMA)))[0]
    reply = client.completions.create(model="tiny", prompt=ids, max_tokens=40, temperature=0,
                                      extra_body={"response_format": FORMAT})
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=ids, max_tokens=40, temperature=0, stream=True,
        extra_body={"response_format": FORMAT}) if c.choices]
    assert "".join(pieces) == expected.text


def test_chat_json_modes_parse_over_seeds(client):
    for seed in range(6):
        for fmt, schema in ((FORMAT, SCHEMA), ({"type": "json_object"}, {"type": "object"})):
            reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=60, temperature=1, seed=seed, response_format=fmt)
            choice = reply.choices[0]
            if choice.finish_reason == "stop":  # (a sampled object may outgrow max_tokens)
                jsonschema.validate(json.loads(choice.message.content), schema)
            else:
                assert choice.finish_reason == "length"


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "yaml"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "extra": 1}},
])
def test_schemas_that_cannot_be_compiled_get_a_400_naming_response_format(server, fmt):
    error = error_of(post(server, {"model": "tiny", "prompt": "a", "max_tokens": 4, "response_format": fmt}), 400)
    assert error["param"].split(".")[0] == "response_format", error
    assert post(server, {"model": "tiny", "prompt": "a", "max_tokens": 4}).status_code == 200


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_a_forced_tool_call_round_trips_through_the_client(client):
    messages = [{"role": "user", "content": "weather?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="required", max_tokens=120, temperature=1, seed=2)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    answer = client.chat.completions.create(
        model="tiny", tools=[WEATHER, TIME], max_tokens=8, temperature=0,
        messages=[*messages, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert answer.choices[0].finish_reason in ("stop", "length")
    named = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"


def test_a_streamed_forced_tool_call_comes_whole_at_the_end(client):
    chunks = [c for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "t"}], tools=[TIME], tool_choice="required",
        max_tokens=60, stream=True) if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments)["zone"] in ("utc", "cet")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_hermes_tool_calls_are_read_from_free_text():
    from dspark.serve.tools import ToolCalls

    reader = ToolCalls(("f", "g"), forced=False)
    content, calls = reader.read('Let me look. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
                                 '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    for text in ('<tool_call>{"name": "h", "arguments": {}}</tool_call>', "no call", "<tool_call>{bad</tool_call>"):
        assert reader.read(text) == (text, [])


@pytest.mark.parametrize("extra, param", [
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strange"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [TIME], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}]}, "messages"),
])
def test_bad_tools_get_a_400_naming_the_field(server, extra, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    error = error_of(post(server, body, "/v1/chat/completions"), 400)
    assert error["param"].split(".")[0] == param, error
