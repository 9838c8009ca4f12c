"""Structured output and tool calling over HTTP (app/serve/structured.py): malformed
``response_format`` / ``tools`` / ``tool_choice`` / tool messages get 400 naming the field (fake
backend, which samples under no grammar and says so); on the bundled SmolLM2 through llama.cpp's
batched slots, a json_schema answer validates, a json_object one parses, a forced call comes back
as tool_calls whose arguments validate, whole and streamed, and a tool result continues the
conversation (SmolLM2's template takes no tools: they go in its system message)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from serve_helpers import serve_in_thread

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                             "parameters": {"type": "object", "required": ["city", "unit"],
                                                            "properties": {"city": {"type": "string", "maxLength": 24},
                                                                           "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
SCHEMA = {"type": "object", "required": ["city", "country", "sunny"],
          "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                         "sunny": {"type": "boolean"}}}
GOOD_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def fake_url():
    session = FakeBackend(0.0).load(None, Plan.fixed("fake", FAKE_SPEC, KVPolicy.parse("fp16"), 4096))
    with serve_in_thread(session, "fake") as (url, _):
        yield url


BAD = [
    ({"response_format": "json"}, "response_format", "'response_format' must be an object"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type 'yaml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format",
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": [1]}}}, "response_format",
     "response_format.json_schema.schema must be a JSON Schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": "yes"}}}, "response_format",
     "strict must be true or false"),
    ({"tools": {"get_weather": {}}}, "tools", "'tools' must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", 'tools[0] must be {"type": "function"'),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "x", "parameters": "none"}}]}, "tools",
     "tools[1].function.parameters must be a JSON Schema object"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two functions have the same name"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "tool_choice 'always'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "naming one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs 'tools'"),
    ({"messages": ASK + [{"role": "tool", "content": "21 C"}]}, "messages", "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]},
     "messages", "messages[1].tool_calls[0]"),
]


@pytest.mark.parametrize("fields, param, says", BAD)
def test_malformed_fields_get_400_naming_them(fake_url, fields, param, says):
    status, body = post(fake_url, "/chat/completions", {"messages": ASK, "max_tokens": 4, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and says in body["error"]["message"], body


def test_tools_need_the_chat_endpoint_and_an_engine_with_a_grammar(fake_url):
    status, body = post(fake_url, "/completions", {"prompt": "hi", "tools": [WEATHER]})
    assert status == 400 and body["error"]["param"] == "tools" and "/v1/chat/completions" in body["error"]["message"]
    status, body = post(fake_url, "/chat/completions", {"messages": ASK, "response_format": GOOD_FORMAT})
    assert status == 400 and body["error"]["param"] == "response_format"
    assert "the fake backend has no constrained decoding" in body["error"]["message"]
    # auto (nothing constrained) and none run anywhere; a text format is no constraint
    for fields in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "none"},
                   {"response_format": {"type": "text"}}):
        status, body = post(fake_url, "/chat/completions", {"messages": ASK, "max_tokens": 4, **fields})
        assert status == 200 and body["choices"][0]["message"]["content"], body


@pytest.fixture(scope="module")
def smollm2():
    session = open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=2048))
    with serve_in_thread(session, "smol", parallel=2) as (url, _):
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600), url
    session.close()


@pytest.mark.slow
def test_json_schema_and_json_object_answers(smollm2):
    c, url = smollm2
    r = c.chat.completions.create(model="smol", messages=ASK, max_tokens=80, temperature=0.7, seed=2,
                                  response_format=GOOD_FORMAT)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Give the capital of France as "
                                                                                       "a JSON object."}],
                                  max_tokens=200, temperature=0, response_format={"type": "json_object"})
    # greedy: sampled at the default temperature with no seed, one CI run in many padded the object to 200 tokens
    assert r.choices[0].finish_reason == "stop"  # room to close the object: a cut one is not JSON
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    status, body = post(url, "/chat/completions", {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 3}}}})
    assert status == 400 and body["error"]["param"] == "response_format" and "'minimum'" in body["error"]["message"]


@pytest.mark.slow
def test_a_forced_call_whole_and_streamed_then_its_result(smollm2):
    c, _ = smollm2
    parameters = WEATHER["function"]["parameters"]
    r = c.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    chunks = [ch for ch in c.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80, temperature=0.8, seed=3, stream=True) if ch.choices]
    calls = [d.tool_calls[0] for d in (ch.choices[0].delta for ch in chunks) if d.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads("".join(x.function.arguments for x in calls)), parameters)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    then = c.chat.completions.create(model="smol", messages=history, tools=[WEATHER], max_tokens=40, temperature=0)
    assert then.choices[0].finish_reason in ("stop", "length")
    assert then.choices[0].message.content and not then.choices[0].message.tool_calls
    assert then.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt
