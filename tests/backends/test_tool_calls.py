"""Tool calling's model side (backends/models/tool_calls.py, chat_template.py): which format a
template calls tools in, a conversation with tools, calls and results rendered through the
template's own ``tools`` or as plain messages, and calls read back out of an answer the same way
whole and split at every character."""
from __future__ import annotations

import json

import pytest

from localctx.backends.base import Chat
from localctx.backends.models import tool_calls
from localctx.backends.models.chat_template import ChatTemplate
from localctx.backends.models.tool_calls import HERMES, LLAMA3_JSON, CallReader, read_all
from tool_templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE, PLAIN_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather <now> & later",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
CALLED = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]


def test_formats_are_detected_from_the_template():
    assert tool_calls.detect(HERMES_TEMPLATE) == (HERMES, True)
    assert tool_calls.detect(LLAMA3_TEMPLATE) == (LLAMA3_JSON, True)
    assert tool_calls.detect(PLAIN_TEMPLATE) == (HERMES, False)
    assert tool_calls.detect("{% for tool in tools %}{{ tool }}{% endfor %}[TOOL_CALLS]") == (HERMES, False)


def test_a_hermes_template_renders_tools_calls_and_results_itself():
    text = ChatTemplate(HERMES_TEMPLATE).render(Chat(CALLED, [WEATHER]))
    # the tools as plain JSON (not Jinja's HTML-escaped tojson), the call's arguments as an object
    assert json.dumps(WEATHER) in text and "\\u003c" not in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    without = ChatTemplate(HERMES_TEMPLATE).render(CALLED)  # no tools offered: no tools section
    assert "Tools:" not in without and "<tool_response>" in without


def test_a_template_without_tools_gets_them_in_the_system_message():
    text = ChatTemplate(PLAIN_TEMPLATE).render(Chat([{"role": "system", "content": "Be brief."}] + CALLED, [WEATHER]))
    system = text.split("</s>")[0]
    assert system.startswith("<system>Be brief.\n\n") and json.dumps(WEATHER) in system and "<tool_call>" in system
    assert '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call></s>' in text
    assert '<user><tool_response>\n{"temp_c": 21}\n</tool_response></s>' in text
    assert "<tool>" not in text  # a template that knows no tool role never sees one


def test_results_in_a_row_are_one_user_turn_and_a_system_turn_is_added():
    two = CALLED + [{"role": "tool", "tool_call_id": "call_2", "content": "second"}]
    out = tool_calls.plain_messages(two, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[-1]["content"].count("<tool_response>") == 2


def test_forced_constraint_names_the_function_and_its_schema():
    c = tool_calls.forced([WEATHER, {"type": "function", "function": {"name": "noop"}}], "get_weather", HERMES)
    assert len(c.shapes) == 1 and c.field == "tool_choice"
    shape = c.shapes[0]
    assert (shape.prefix, shape.suffix) == ("<tool_call>\n", "\n</tool_call>")
    schema = json.loads(shape.schema)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]
    both = tool_calls.forced([WEATHER, {"type": "function", "function": {"name": "noop"}}], None, LLAMA3_JSON)
    assert [json.loads(s.schema)["properties"]["name"]["const"] for s in both.shapes] == ["get_weather", "noop"]
    assert "parameters" in json.loads(both.shapes[1].schema)["required"]


ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "when": {"day": 1}}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')


def _pieces_split(text: str, reader: CallReader, cuts: list[int]):
    out, last = [], 0
    for cut in cuts + [len(text)]:
        out += reader.feed(text[last:cut])
        last = cut
    return out + reader.finish()


def _collect(pieces):
    text, calls = "", []
    for p in pieces:
        if p.kind == "text":
            text += p.text
        elif p.kind == "call":
            calls.append([p.name, ""])
        else:
            calls[-1][1] += p.text
    return text.strip(), [(n, json.loads(a)) for n, a in calls]


@pytest.mark.parametrize("incremental", [False, True])
def test_calls_read_the_same_whole_and_at_every_split(incremental):
    whole = _collect(_pieces_split(ANSWER, CallReader(HERMES, ["get_weather"], incremental), []))
    assert whole == ("Let me check.", [("get_weather", {"city": "Paris", "when": {"day": 1}}),
                                       ("get_weather", {"city": "Lyon"})])
    for cut in range(1, len(ANSWER)):
        assert _collect(_pieces_split(ANSWER, CallReader(HERMES, ["get_weather"], incremental), [cut])) == whole
    one_by_one = CallReader(HERMES, ["get_weather"], incremental)
    assert _collect(_pieces_split(ANSWER, one_by_one, list(range(1, len(ANSWER))))) == whole


def test_streamed_arguments_come_as_they_are_generated():
    reader = CallReader(HERMES, ["get_weather"], streaming_arguments=True)
    pieces = reader.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [p.kind for p in pieces] == ["call", "arguments"] and pieces[1].text == '{"city": "Pa'
    assert reader.feed('ris"}}\n</tool_') == [tool_calls.Piece("arguments", 'ris"}')]
    assert reader.feed("call>") + reader.finish() == []


def test_a_forced_calls_arguments_end_where_their_json_ends_not_at_a_close_tag_inside_a_string():
    """A forced call's grammar lets a string hold anything: a sampled SmolLM2 call once wrote the city
    "Paris'}}\n</tool_call>" before closing it, and the reader, ending the arguments at the first close
    tag, passed on '{"city": "Paris\'}' (not JSON)."""
    city = "Paris'}}\n</tool_call>\n{\"x\": [1, \"]\"]} \\"
    answer = ('<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps({"city": city, "n": [1, {"a": -2.5}]})
              + '}\n</tool_call>')
    want = ("", [("get_weather", {"city": city, "n": [1, {"a": -2.5}]})])
    for cuts in [[]] + [[c] for c in range(1, len(answer))] + [list(range(1, len(answer)))]:
        assert _collect(_pieces_split(answer, CallReader(HERMES, ["get_weather"], True), cuts)) == want
    _content, calls = read_all(answer, HERMES, ["get_weather"], streaming_arguments=True)
    assert json.loads(calls[0][2]) == want[1][0][1]
    cut_short = read_all(answer[:60], HERMES, ["get_weather"], streaming_arguments=True)  # max_tokens inside the value
    assert cut_short[1][0][2] == answer[answer.index('{"city"'):60]


def test_a_calls_block_ends_after_its_json_object_not_at_a_close_tag_inside_a_string():
    """Unconstrained (tool_choice auto), a model may write the close tag inside an argument: the block
    is read to the first close tag after its JSON object, whole and split at every point, and what
    follows stays text."""
    note = 'use </tool_call> to end a call, and {"braces"} too'
    answer = ('Saving it.<tool_call>\n' + json.dumps({"name": "save", "arguments": {"note": note}})
              + '\n</tool_call> Done.')
    want = ("Saving it. Done.", [("save", {"note": note})])
    for cuts in [[]] + [[c] for c in range(1, len(answer))] + [list(range(1, len(answer)))]:
        assert _collect(_pieces_split(answer, CallReader(HERMES, ["save"]), cuts)) == want
    # a block whose object never ends still ends at the first close tag, as text
    broken = '<tool_call>\n{"name": "save", "arguments": {"note": "open</tool_call> then prose'
    assert read_all(broken, HERMES, ["save"]) == (broken, [])


def test_what_is_not_a_call_of_a_known_function_stays_text():
    for text in ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "<tool_call>\nnot json\n</tool_call>",
                 "a < b and <tool", "<tool_call>{\"name\": \"get_weather\""):
        content, calls = read_all(text, HERMES, ["get_weather"])
        assert calls == [] and content == text.strip()


def test_llama3_json_answers_are_one_call_or_text():
    content, calls = read_all(' {"name": "get_weather", "parameters": {"city": "Oslo"}}', LLAMA3_JSON, ["get_weather"])
    assert content == "" and [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Oslo"})]
    assert read_all("It is sunny.", LLAMA3_JSON, ["get_weather"]) == ("It is sunny.", [])
    assert read_all('{"answer": 1}', LLAMA3_JSON, ["get_weather"]) == ('{"answer": 1}', [])


def test_an_answer_of_bare_call_objects_is_read_as_calls():
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for fmt in (HERMES, LLAMA3_JSON):
        content, calls = read_all(bare, fmt, ["get_weather"])
        assert content == "" and [json.loads(a)["city"] for _, _, a in calls] == ["Paris", "Oslo"]
    for text in ('{"name": "get_weather", "arguments": {"city": "Paris"}} and more', '{"answer": 42}', "{"):
        assert read_all(text, HERMES, ["get_weather"]) == (text, [])
    pieces = _pieces_split(bare, CallReader(HERMES, ["get_weather"]), list(range(1, len(bare))))
    assert [p.kind for p in pieces] == ["call", "arguments", "call", "arguments"]
