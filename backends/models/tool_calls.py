"""Tool calling in a model's own format: which format its chat template calls tools in, the
conversation as a template without tools support can take it, the grammar of a forced call, and the
calls read back out of the answer, whole or as it streams (``CallReader``).

Formats (``detect``):
- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, once per call (Qwen2.5,
  Qwen3, Hermes, SmolLM3 templates: those that write ``<tool_call>``);
- ``llama3-json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (Llama 3.1 / 3.2 templates:
  those that take ``tools`` and write ``"parameters"``);
- a template that does not take ``tools`` (or calls them some other way) gets the tools and the
  hermes instructions in its system message, and earlier calls and results as plain text
  (``plain_messages``); its answers are read as hermes."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Sequence

from localctx.backends.base import JsonShape, OutputConstraint


@dataclass(frozen=True)
class ToolFormat:
    name: str
    prefix: str  # before one call's JSON object
    suffix: str  # after it
    arguments_key: str  # the key of the arguments in that object


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")
LLAMA3_JSON = ToolFormat("llama3-json", "", "", "parameters")


def detect(template_source: str) -> tuple[ToolFormat, bool]:
    """(the format answers call tools in, whether the template itself renders ``tools``)."""
    if not re.search(r"\btools\b", template_source):
        return HERMES, False
    if "<tool_call>" in template_source:
        return HERMES, True
    if '"parameters"' in template_source:
        return LLAMA3_JSON, True
    return HERMES, False


def function_of(tool: dict) -> dict:
    """OpenAI's ``{"type": "function", "function": {...}}``: the function's name, description, parameters."""
    return tool.get("function") or {}


def parameters_schema(tool: dict) -> dict:
    """The function's JSON Schema (a function without ``parameters`` takes none)."""
    return function_of(tool).get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def forced(tools: Sequence[dict], name: str | None, fmt: ToolFormat, field: str = "tool_choice") -> OutputConstraint:
    """The answer is one call of the function ``name`` (None: of any of ``tools``), its arguments valid
    against the function's schema."""
    shapes = []
    for tool in tools:
        fn = function_of(tool)
        if name is not None and fn.get("name") != name:
            continue
        call = {"type": "object", "properties": {"name": {"const": fn["name"]}, fmt.arguments_key: parameters_schema(tool)},
                "required": ["name", fmt.arguments_key], "additionalProperties": False}
        shapes.append(JsonShape(json.dumps(call), fmt.prefix, fmt.suffix))
    return OutputConstraint(tuple(shapes), field)


# -- rendering ------------------------------------------------------------------------------------
def _arguments_object(arguments) -> object:
    """A call's arguments as templates take them (a JSON string from OpenAI's clients becomes the object)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def native_messages(messages: Sequence[dict]) -> list[dict]:
    """The messages for a template that renders tools: each call's arguments as an object."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            calls = [{**c, "function": {**function_of(c), "arguments": _arguments_object(function_of(c).get("arguments"))}}
                     for c in calls]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def instructions(tools: Sequence[dict]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to answer. They are described, one JSON object each, between <tools> and "
            f"</tools>:\n<tools>\n{listed}\n</tools>\n\nTo call one, answer with a JSON object holding its name and "
            "arguments between <tool_call> and </tool_call>:\n<tool_call>\n"
            '{"name": "the function\'s name", "arguments": {"argument": "value"}}\n</tool_call>')


def _call_text(call: dict) -> str:
    fn = function_of(call)
    body = {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def plain_messages(messages: Sequence[dict], tools: Sequence[dict]) -> list[dict]:
    """The conversation for a template without tools support: the tools and how to call them at
    the end of the system message (one is added if there is none), calls as hermes text in the
    assistant's turns, and tool results as user turns (consecutive results in one)."""
    out: list[dict] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join(([content] if content else []) + [_call_text(c) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("from_tool"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result, "from_tool": True})
        else:
            out.append({"role": role, "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instructions(tools)}
        else:
            out.insert(0, {"role": "system", "content": instructions(tools)})
    return out


# -- reading the answer ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """What a CallReader found: ``text`` (answer text), or a call's start (``call_id`` and ``name``),
    or more of its ``arguments`` (JSON text, in order)."""
    kind: str  # "text" | "call" | "arguments"
    text: str = ""
    call_id: str = ""
    name: str = ""


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _ValueScan:
    """Finds where the JSON value at the start of a growing text ends (leading whitespace skipped), scanning
    each character once however the text arrives. Brackets are counted outside strings only: a forced
    call's grammar lets a string hold anything, the close tag "</tool_call>" and unbalanced braces
    included, so the first close tag is not where the arguments end."""

    def __init__(self):
        self.pos, self.depth, self.in_string, self.escaped = 0, 0, False, False
        self.found: int | None = None  # the end, once seen (asked again, the same answer)

    def end(self, text: str) -> int | None:
        """The index just past the value in ``text`` (which extends the text seen before), or None."""
        if self.found is None:
            self.found = self._scan(text)
        return self.found

    def _scan(self, text: str) -> int | None:
        for i in range(self.pos, len(text)):
            c = text[i]
            self.pos = i + 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}],":
                if self.depth == 0:  # a number or literal at the top ended before this
                    return i
                if c != ",":
                    self.depth -= 1
                    if self.depth == 0:
                        return i + 1
        return None


def _call(obj, fmt: ToolFormat, names: set[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's object, or None when it is not a call of a known function."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(fmt.arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class CallReader:
    """Reads an answer as it streams into text and calls. ``streaming_arguments``: the answer is
    grammar-constrained to calls (a forced call), so a call's arguments are passed on as they come;
    otherwise a call is passed on whole once it ends and parses (a block that does not parse as a
    call of a known function stays text). An answer that starts with "{" is held to its end and read
    as calls when it is nothing but call objects (llama3-json's form; small hermes models, such as
    Qwen2.5-Coder-0.5B, write their calls so too), else as text."""

    def __init__(self, fmt: ToolFormat, names: Sequence[str], streaming_arguments: bool = False):
        self.fmt, self.names, self.incremental = fmt, set(names), streaming_arguments
        self.buf, self.state, self.sent = "", "start", ""
        self.scan = _ValueScan()  # the streamed arguments' end (a new one per call)
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        return self._drain(final=True)

    def _new_call(self, name: str) -> Piece:
        self.calls += 1
        return Piece("call", call_id="call_" + uuid.uuid4().hex[:24], name=name)

    def _whole(self, block: str, raw: str) -> list[Piece]:
        """One hermes block read as a call, or ``raw`` as text."""
        try:
            found = _call(json.loads(block), self.fmt, self.names)
        except ValueError:
            found = None
        if found is None:
            return [Piece("text", raw)] if raw else []
        return [self._new_call(found[0]), Piece("arguments", found[1])]

    def _bare(self, raw: str) -> list[Piece]:
        """A whole answer of call objects (whitespace between) read as calls, or as text."""
        text, pos, found, decoder = raw.strip(), 0, [], json.JSONDecoder()
        while pos < len(text):
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return [Piece("text", raw)]
            call = _call(obj, self.fmt, self.names)
            if call is None:
                return [Piece("text", raw)]
            found.append(call)
            pos = len(text) - len(text[pos:].lstrip())
        return [p for name, args in found for p in (self._new_call(name), Piece("arguments", args))]

    def _block_end(self, final: bool) -> int | None:
        """Where a whole call's block ends in the buffer: the first close tag after its JSON object (a
        string in it may hold "</tool_call>"); -1 at the end of the answer without a close tag; None:
        not known yet. A block that does not start with "{", or whose object never ends, ends at the
        first close tag (it is text either way)."""
        stripped = self.buf.lstrip()
        if not stripped and not final:
            return None
        end = self.scan.end(self.buf) if stripped.startswith("{") else 0
        if end is None and not final:
            return None  # the object is still open: a close tag seen so far may be inside a string
        j = self.buf.find(_CLOSE, end or 0)
        return None if j < 0 and not final else j

    def _drain(self, final: bool) -> list[Piece]:
        if self.state == "start":
            stripped = self.buf.lstrip()
            if not stripped and not final:
                return []
            self.state = "bare" if stripped.startswith("{") else "prose" if self.fmt is LLAMA3_JSON else "text"
        if self.state in ("bare", "prose"):  # held to the end, or all text (llama3-json's prose)
            if self.state == "bare" and not final:
                return []
            out, self.buf = (self._bare(self.buf) if self.state == "bare" else [Piece("text", self.buf)]), ""
            return [p for p in out if p.kind != "text" or p.text]
        out: list[Piece] = []
        while True:
            if self.state == "text":
                i = self.buf.find(_OPEN)
                if i < 0:
                    keep = 0 if final else _partial_tail(self.buf, _OPEN)
                    if len(self.buf) > keep:
                        out.append(Piece("text", self.buf[:len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if i:
                    out.append(Piece("text", self.buf[:i]))
                self.buf, self.state = self.buf[i + len(_OPEN):], "call"
                self.scan = _ValueScan()
            elif self.state == "call":
                head = _HERMES_HEAD.match(self.buf) if self.incremental else None
                if head is not None:
                    out.append(self._new_call(json.loads(f'"{head.group(1)}"')))
                    self.buf, self.state, self.sent = self.buf[head.end():], "arguments", ""
                    self.scan = _ValueScan()
                    continue
                j = self._block_end(final)
                if j is None:
                    return out
                block = self.buf if j < 0 else self.buf[:j]
                out += self._whole(block, _OPEN + self.buf[:len(self.buf) if j < 0 else j + len(_CLOSE)])
                self.buf, self.state = ("" if j < 0 else self.buf[j + len(_CLOSE):]), "text"
            elif self.state == "arguments":  # streamed (grammar-constrained) up to the end of the JSON value
                start = len(self.buf) - len(self.buf.lstrip())
                end = self.scan.end(self.buf)
                shown = self.buf[start:] if end is None else self.buf[start:end].rstrip()
                if len(shown) > len(self.sent):
                    out.append(Piece("arguments", shown[len(self.sent):]))
                    self.sent = shown
                if end is None and not final:
                    return out
                self.buf, self.state = ("" if end is None else self.buf[end:]), "closing"
            else:  # closing: the call object's "}" and the close tag after its arguments
                j = self.buf.find(_CLOSE)
                if j < 0 and not final:
                    return out
                self.buf, self.state = ("" if j < 0 else self.buf[j + len(_CLOSE):]), "text"


def read_all(text: str, fmt: ToolFormat, names: Sequence[str], streaming_arguments: bool = False
             ) -> tuple[str, list[tuple[str, str, str]]]:
    """A whole answer's text (calls removed, stripped) and its calls as (id, name, arguments)."""
    reader = CallReader(fmt, names, streaming_arguments)
    text_parts, calls = [], []
    for piece in reader.feed(text) + reader.finish():
        if piece.kind == "text":
            text_parts.append(piece.text)
        elif piece.kind == "call":
            calls.append([piece.call_id, piece.name, ""])
        else:
            calls[-1][2] += piece.text
    return "".join(text_parts).strip(), [tuple(c) for c in calls]
