"""Structured output and tool calling in OpenAI's shapes: ``response_format``, ``tools``,
``tool_choice`` and the messages of a tool conversation (an assistant's ``tool_calls``, ``role:
"tool"`` results) in a request; ``message.tool_calls`` and streamed tool-call deltas in the answer.

protocol.py parses a body through ``parse`` and ``message_fields``; the HTTP side calls ``prepare``
(off the event loop: it compiles grammars) once the served session is known, since a forced call's
grammar follows the model's own tool-call format (backends/models/tool_calls.py), and every grammar
is checked against the session's engine there (400 naming the field it came from)."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from localctx.backends.base import Chat, OutputConstraint, Prompt, Session
from localctx.backends.models import tool_calls
from localctx.backends.models.tool_calls import CallReader, ToolFormat

MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 64 * 1024  # a schema's JSON text: its grammar is compiled per request
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")


class FieldError(ValueError):
    """A malformed field: ``param`` names it (protocol.py answers 400 with both)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers and its ``tool_choice``: "auto", "required", or "function"
    (``name`` must be called). ``format`` and ``forced`` are set by ``prepare``."""
    tools: tuple[dict, ...]
    choice: str
    name: str | None = None
    format: ToolFormat = tool_calls.HERMES
    forced: bool = False

    @property
    def names(self) -> list[str]:
        return [tool_calls.function_of(t)["name"] for t in self.tools]


# -- the request ----------------------------------------------------------------------------------
def param_of(field: str) -> str:
    """The top-level request field a path names: "tools" for "tools[2].function.parameters"."""
    return re.split(r"[.\[]", field, maxsplit=1)[0]


def _schema_text(schema, where: str) -> str:
    if not isinstance(schema, dict):
        raise FieldError(f"{where} must be a JSON Schema object", param_of(where))
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise FieldError(f"{where} is {len(text):,} characters of JSON; the server takes schemas up to "
                         f"{MAX_SCHEMA_CHARS:,}", param_of(where))
    return text


def response_format(value) -> OutputConstraint | None:
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}``: the answer's constraint (None for text). A schema is enforced
    whether ``strict`` is true or not."""
    if value is None:
        return None
    example = '{"type": "json_schema", "json_schema": {"name": "answer", "schema": {...}}}'
    if not isinstance(value, dict):
        raise FieldError(f"'response_format' must be an object like {example}", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint.json_schema('{"type": "object"}')
    if kind != "json_schema":
        raise FieldError(f"response_format.type {kind!r} is not one of text, json_object, json_schema",
                         "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError(f"response_format.json_schema must be an object like {example}", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise FieldError("response_format.json_schema.name must be 1-64 letters, digits, _ or -", "response_format")
    if not isinstance(spec.get("strict", False), bool):
        raise FieldError("response_format.json_schema.strict must be true or false", "response_format")
    schema = spec.get("schema", {"type": "object"})
    return OutputConstraint.json_schema(_schema_text(schema, "response_format.json_schema.schema"))


def _tool(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise FieldError(f'{where} must be {{"type": "function", "function": {{"name", "description", '
                         '"parameters"}}', "tools")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
        raise FieldError(f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise FieldError(f"{where}.function.description must be a string", "tools")
    if fn.get("parameters") is not None:
        _schema_text(fn["parameters"], f"{where}.function.parameters")
    return {"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters") if k in fn}}


def tool_request(body: dict, chat: bool) -> ToolRequest | None:
    """``tools`` and ``tool_choice``: None when no tool may be called (no tools, or "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and choice is None:
        return None
    if not chat:
        raise FieldError("tools and tool_choice need /v1/chat/completions", "tools")
    if tools is not None and (not isinstance(tools, list) or len(tools) > MAX_TOOLS):
        raise FieldError(f"'tools' must be a list of at most {MAX_TOOLS} functions", "tools")
    tools = [_tool(t, i) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise FieldError("tools: two functions have the same name", "tools")
    if not isinstance(body.get("parallel_tool_calls", True), bool):
        raise FieldError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or fn.get("name") not in names:
            raise FieldError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": N}} naming one of the tools', "tool_choice")
        choice, named = "function", fn["name"]
    elif choice is None:
        choice = "auto" if tools else "none"
    elif choice not in CHOICES:
        raise FieldError(f'tool_choice {choice!r} is not "none", "auto", "required" or a named function', "tool_choice")
    if choice in ("required", "function") and not tools:
        raise FieldError(f"tool_choice {choice!r} needs 'tools'", "tool_choice")
    if choice == "none" or not tools:
        return None
    return ToolRequest(tuple(tools), choice, named)


def _call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str) \
            or not isinstance(call.get("id", ""), str):
        raise FieldError(f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments": '
                         'a JSON string}}}}', "messages")
    return {"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}


def message_fields(m: dict, i: int) -> dict:
    """The tool fields of message ``i`` (OpenAI's): an assistant's ``tool_calls``, a tool result's
    ``tool_call_id``; {} for any other message."""
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise FieldError(f"messages[{i}].tool_call_id must be the id of the call this result answers", "messages")
        return {"tool_call_id": m["tool_call_id"]}
    calls = m.get("tool_calls")
    if m["role"] != "assistant" or calls is None:
        return {}
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise FieldError(f"messages[{i}].tool_calls must be a list of calls", "messages")
    return {"tool_calls": [_call(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(calls)]}


def with_tools(prompt: Prompt, tools: ToolRequest | None) -> Prompt:
    """The chat with the functions its template should render."""
    if tools is None or isinstance(prompt, str):
        return prompt
    return Chat(prompt, tools.tools)


# -- against the served engine --------------------------------------------------------------------
def prepare(params, tools: ToolRequest | None, session: Session):
    """(params, tools) with the answer's constraint: a forced call's grammar in the model's own
    format, or (``auto`` with a response_format) a call or the schema's JSON. Each schema is checked
    against the session's engine; raises FieldError naming the first it refuses."""
    constraint = params.constraint
    parts = [constraint] if constraint is not None else []
    if tools is not None:
        fmt = session.tool_format()
        tools = dataclasses.replace(tools, format=fmt, forced=tools.choice in ("required", "function"))
        for i, tool in enumerate(tools.tools):
            parts.append(tool_calls.forced([tool], None, fmt, field=f"tools[{i}].function.parameters"))
        if tools.forced:
            constraint = tool_calls.forced(tools.tools, tools.name, fmt)
        elif constraint is not None:
            calls = tool_calls.forced(tools.tools, None, fmt)
            constraint = OutputConstraint(calls.shapes + constraint.shapes, constraint.field)
        else:
            parts = []  # auto without response_format: nothing is constrained
    for part in parts + ([constraint] if constraint is not None else []):
        reason = session.constraint_refusal(part)
        if reason:
            raise FieldError(reason, param_of(part.field))
    return dataclasses.replace(params, constraint=constraint), tools


# -- the answer -----------------------------------------------------------------------------------
def with_calls(response: dict, text: str, tools: ToolRequest) -> dict:
    """A whole chat completion (protocol.whole) with the calls in its answer ``text`` as
    ``message.tool_calls`` (``content`` what text is left, or null) and finish_reason "tool_calls"."""
    content, calls = tool_calls.read_all(text, tools.format, tools.names, tools.forced)
    choice = response["choices"][0]
    choice["message"] = {"role": "assistant", "content": content or None}
    if calls:
        choice["message"]["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                                           for cid, name, args in calls]
        choice["finish_reason"] = finish_with_calls(choice["finish_reason"], True)
    return response


def finish_with_calls(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason


def delta_chunk(ids, delta: dict) -> dict:
    """A chat.completion.chunk carrying ``delta`` (``ids``: protocol.Ids)."""
    return {**ids.head("chat.completion.chunk"),
            "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}]}


class StreamedCalls:
    """A streamed answer's deltas: its text as ``content``, its calls as OpenAI's tool-call deltas (the
    first of a call with its id and name, then its arguments as they come)."""

    def __init__(self, tools: ToolRequest):
        self.reader = CallReader(tools.format, tools.names, tools.forced)
        self.index = -1  # of the call being streamed

    @property
    def called(self) -> bool:
        return self.reader.calls > 0

    def deltas(self, text: str, final: bool = False) -> list[dict]:
        pieces = self.reader.feed(text) + (self.reader.finish() if final else [])
        out = []
        for p in pieces:
            if p.kind == "text" and p.text:
                out.append({"content": p.text})
            elif p.kind == "call":
                self.index += 1
                out.append({"tool_calls": [{"index": self.index, "id": p.call_id, "type": "function",
                                            "function": {"name": p.name, "arguments": ""}}]})
            elif p.kind == "arguments" and p.text:
                out.append({"tool_calls": [{"index": self.index, "function": {"arguments": p.text}}]})
        return out
