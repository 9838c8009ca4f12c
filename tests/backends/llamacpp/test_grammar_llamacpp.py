"""Structured output on llama.cpp (backends/llamacpp/grammar.py): what the converter cannot enforce
is refused by name, the grammar keeps JSON's string rule, and answers sampled under it on the
bundled SmolLM2 validate against their schema in the single session, in llama.cpp's batched slots
beside an unconstrained stream, and in generate_batch."""
from __future__ import annotations

import json

import jsonschema
import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams, JsonShape, OutputConstraint
from localctx.backends.llamacpp import grammar
from localctx.backends.llamacpp.serving import LlamaSlots
from localctx.kvcache.errors import UserError

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
                         "born": {"type": "string", "format": "date"}},
          "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}}}
ASK = [{"role": "user", "content": "Describe Ann, 31, who has a cat, as JSON."}]


def constraint(schema) -> OutputConstraint:
    return OutputConstraint.json_schema(json.dumps(schema))


@pytest.mark.parametrize("schema, named", [
    ({"type": "integer", "minimum": 1}, "'minimum'"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}, "'multipleOf' at $.properties.n"),
    ({"oneOf": [{"type": "string"}]}, "'oneOf' (use anyOf)"),
    ({"type": "string", "format": "email"}, "format 'email'"),
    ({"type": "object", "required": ["x"]}, "'required' naming a property"),
    ({"type": ["object", "null"], "properties": {"a": {}}}, "a list of types beside other keywords"),
    ({"type": "array", "items": {"not": {}}}, "'not' at $.items[0]"),
    ({"enum": ["a\\b"]}, "a backslash"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "minLength/maxLength beside pattern"),
])
def test_what_the_converter_would_not_enforce_is_refused_by_name(schema, named):
    with pytest.raises(UserError) as err:
        grammar.gbnf(constraint(schema))
    assert named in str(err.value) and str(err.value).startswith("response_format: llama.cpp's grammar cannot enforce")


def test_the_grammar_keeps_json_strings_and_each_shape_apart():
    two = OutputConstraint((JsonShape(json.dumps(PERSON), "<tool_call>\n", "\n</tool_call>"),
                            JsonShape(json.dumps({"type": "object", "properties": {"Pet": {"type": "integer"}}}))))
    text = grammar.gbnf(two)
    assert text.splitlines()[0] == 'root ::= ("<tool_call>\\x0A" s0-root "\\x0A</tool_call>") | (s1-root)'
    assert f"s0-char ::= {grammar.CHAR_RULE}" in text  # no raw control character inside a string
    assert "s0-Pet ::=" in text and "s1-Pet-kv ::=" in text  # each shape's rules under its own prefix


@pytest.fixture(scope="module")
def session():
    s = open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=1024))
    yield s
    s.close()


def answer(events) -> str:
    events = list(events)
    assert events[-1].finish_reason == "stop", events[-1]
    return "".join(e.text for e in events)


@pytest.mark.slow
def test_answers_validate_against_the_schema_greedy_and_sampled(session):
    assert session.constraint_refusal(constraint(PERSON)) is None
    for temperature, seed in ((0.0, None), (1.0, 1)):
        text = answer(session.generate(ASK, GenerationParams(max_tokens=100, temperature=temperature, seed=seed,
                                                             constraint=constraint(PERSON))))
        jsonschema.validate(json.loads(text), PERSON)
    capital = [{"role": "user", "content": "Give the capital of France as a JSON object."}]
    text = answer(session.generate(capital, GenerationParams(max_tokens=60, constraint=constraint({"type": "object"}))))
    assert isinstance(json.loads(text), dict)


@pytest.mark.slow
def test_batched_slots_constrain_each_stream_alone(session):
    free = GenerationParams(max_tokens=24)
    alone = "".join(e.text for e in session.generate(ASK, free))  # greedy, no grammar, no other stream
    session.reset()
    slots = LlamaSlots(session, n_slots=2)
    try:
        started = [slots.start(ASK, GenerationParams(max_tokens=100, temperature=1.0, seed=3,
                                                     constraint=constraint(PERSON)), None),
                   slots.start(ASK, free, None)]
        texts = {id(s): [] for s, _ in started}  # prefilled by the steps: the first tokens come from them
        done = {}
        while slots.active:
            for s, e in slots.step():
                texts[id(s)].append(e.text)
                if e.kind == "done":
                    done[id(s)] = e
        constrained, unconstrained = ("".join(texts[id(s)]) for s, _ in started)
        assert done[id(started[0][0])].finish_reason == "stop"
        jsonschema.validate(json.loads(constrained), PERSON)
        assert unconstrained == alone  # the grammar stayed with its own stream
    finally:
        slots.close()
    batch = GenerationParams(max_tokens=100, temperature=1.0, seed=5, constraint=constraint(PERSON))
    texts = {}
    for i, event in session.generate_batch([ASK, ASK], batch):
        texts[i] = texts.get(i, "") + event.text
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)
