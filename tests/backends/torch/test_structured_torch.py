"""Structured output and tool calling on the torch backend (llguidance: backends/generation/guided.py)
on a tiny random-weight GGUF whose chat template renders tools (tests/tool_templates.py): whatever
the weights, answers sampled under a schema validate against it, alone and batched beside an
unconstrained stream, and a forced call over HTTP comes back as tool_calls whose arguments validate,
whole and streamed; a tool result continues the conversation."""
from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest
import torch

from localctx.app.serve.streams import make_streams
from localctx.backends.base import GenerationParams, OutputConstraint
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from serve_helpers import serve_in_thread
from tool_templates import HERMES_TEMPLATE
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
# a finite language: every answer ends, even from random weights (integers bounded, strings enumerated)
ANSWER = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tags", "who"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 40},
                         "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3},
                         "who": {"anyOf": [{"type": "null"}, {"enum": ["ann", "bo"]}]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                             "parameters": {"type": "object", "additionalProperties": False,
                                                            "required": ["city", "unit"],
                                                            "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                                           "unit": {"enum": ["c", "f"]}}}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
ASK = [{"role": "user", "content": "the tent in the sea"}]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    cfg = TinyConfig(context=4096)  # the tools take some 400 byte-sized tokens in the prompt
    path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", cfg, tiny_weights(cfg, seed=5), HERMES_TEMPLATE)
    return load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)


def new_session(loaded, context=2000):
    return build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse("fp16"), context), OPTIONS)


def constrained(seed, temperature=1.0) -> GenerationParams:
    return GenerationParams(max_tokens=200, temperature=temperature, seed=seed,
                            constraint=OutputConstraint.json_schema(json.dumps(ANSWER)))


def test_answers_validate_whatever_the_weights(loaded):
    session = new_session(loaded)
    assert session.constraint_refusal(constrained(0).constraint) is None
    for seed, temperature in ((None, 0.0), (1, 1.0), (2, 1.0), (3, 1.5)):
        events = list(session.generate(ASK, constrained(seed, temperature)))
        assert events[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(e.text for e in events)), ANSWER)
    free = "".join(e.text for e in session.generate(ASK, GenerationParams(max_tokens=30, temperature=1.0, seed=1)))
    with pytest.raises(ValueError):
        json.loads(free)  # random weights alone write no JSON: the grammar made the answers above


def test_a_schema_llguidance_cannot_compile_is_refused_with_its_reason(loaded):
    reason = new_session(loaded).constraint_refusal(OutputConstraint.json_schema('{"not": {"type": "string"}}'))
    assert reason.startswith("response_format: llguidance cannot compile the schema") and '"not"' in reason
    assert "\n" not in reason


def test_batched_streams_keep_their_own_grammar(loaded):
    session = new_session(loaded)
    batcher = make_streams(session, 3)
    started = [batcher.start(ASK, constrained(7), None), batcher.start(ASK, GenerationParams(max_tokens=20), None),
               batcher.start(ASK, constrained(8), None)]
    texts = {id(s): "" for s, _ in started}
    while batcher.active:
        for s, e in batcher.step():
            texts[id(s)] += e.text
    assert batcher.widest >= 2
    first, free, third = (texts[id(s)] for s, _ in started)
    for text in (first, third):
        jsonschema.validate(json.loads(text), ANSWER)
    assert not free.startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_over_http_whole_and_streamed(loaded, choice):
    with serve_in_thread(new_session(loaded), "tiny", parallel=2) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, NOOP], tool_choice=choice,
                                           max_tokens=120, temperature=1.0, seed=4)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        if isinstance(choice, dict) or call.function.name == "get_weather":
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        else:
            assert (call.function.name, json.loads(call.function.arguments)) == ("noop", {})
        stream = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=choice,
                                                max_tokens=120, temperature=1.0, seed=6, stream=True)
        chunks = list(stream)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
        assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
        assert len(calls) > 2 and all(c.index == 0 and c.id is None for c in calls[1:])  # arguments come in pieces
        arguments = "".join(c.function.arguments for c in calls)
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert not "".join(d.content or "" for d in deltas).strip()


def test_a_tool_result_continues_the_conversation(loaded):
    session = new_session(loaded)
    with serve_in_thread(session, "tiny", parallel=1) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                               max_tokens=120)
        call = first.choices[0].message.tool_calls[0]
        history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
        then = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=5)
        assert then.choices[0].finish_reason in ("stop", "length", "tool_calls")
        # the turn that called and the result are in the prompt, rendered by the model's template
        rendered = session.template.render(session_chat(history))
        assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in rendered
        assert then.usage.prompt_tokens == session.count_tokens(session_chat(history))
        assert then.usage.prompt_tokens_details.cached_tokens > 0  # the earlier turn's KV was kept
        counted = urllib.request.Request(url.removesuffix("/v1") + "/localctx/count_tokens", method="POST",
                                         data=json.dumps({"messages": history, "tools": [WEATHER]}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(counted, timeout=60) as resp:  # the count renders the tools too
            assert json.loads(resp.read())["count"] == then.usage.prompt_tokens


def session_chat(history):
    from localctx.backends.base import Chat

    messages = [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id")} for m in history]
    for m in messages:
        m["content"] = m.get("content") or ""
    return Chat(messages, [WEATHER])
