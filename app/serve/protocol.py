"""OpenAI's request and response shapes: parsing a request body into a prompt, generation
parameters and the ``localctx`` extension; building completions, chunks and errors.

Unknown fields are ignored, as OpenAI-compatible servers do; nothing in a request can name a
file or another model (``model`` must be the served model's id, or absent). Every field a request
may carry is checked in one place: the numbers in ``NUMBERS`` (range, finite, kind), each other
field by its own reader here; a body nested deeper than ``MAX_DEPTH`` is refused as it is parsed."""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from localctx.app.serve import structured
from localctx.app.serve.structured import ToolRequest
from localctx.backends.base import GenerationEvent, GenerationParams, OutputConstraint, Prompt
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy

DEFAULT_MAX_TOKENS = 512  # an answer's limit when the request gives none (at most the server's cap)
DEFAULT_MAX_TOKENS_CAP = 4096  # --max-tokens: the most tokens one answer may have
MAX_STOPS = 4
MAX_DEPTH = 64  # JSON nesting: OpenAI bodies need a handful of levels (a JSON schema a few more)
ROLES = ("system", "user", "assistant", "developer", "tool")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ParsedRequest:
    prompt: Prompt
    params: GenerationParams
    stream: bool
    include_usage: bool
    context: int | None  # from the localctx extension
    chat: bool
    policy: KVPolicy | None = None  # from the localctx extension; None: the served policy
    capped_from: int | None = None  # the max_tokens asked for, when the server's --max-tokens lowered it
    tools: ToolRequest | None = None  # functions the answer may call (app/serve/structured.py)


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def parse_json(raw: bytes):
    """The body as JSON, or 400: not JSON, or nested deeper than MAX_DEPTH (Python's parser recurses:
    a far deeper body stops it with a RecursionError, answered here as the same 400). NaN and
    Infinity, which Python reads, are left to the field's check, which names the field."""
    too_deep = _bad(f"the request body nests JSON deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except ValueError:  # UnicodeDecodeError is a ValueError
        raise _bad("the request body is not valid JSON") from None
    if _depth(body) > MAX_DEPTH:
        raise too_deep
    return body


def _depth(value) -> int:
    """How deeply lists and objects nest in ``value`` (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_DEPTH:
            todo.extend((child, level + 1) for child in children)
    return deepest


def _content(value, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text only
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    if value is None:
        return ""
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}] needs a role among {', '.join(ROLES)}", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m.get("content"), i), **_tool_fields(m, i)})
    return out


def _tool_fields(m: dict, i: int) -> dict:
    """An assistant's ``tool_calls`` or a tool result's ``tool_call_id`` (app/serve/structured.py)."""
    try:
        return structured.message_fields(m, i)
    except structured.FieldError as exc:
        raise _bad(str(exc), exc.param) from None


def _structured(body: dict, chat: bool) -> tuple[OutputConstraint | None, ToolRequest | None]:
    """``response_format``'s constraint and the ``tools`` / ``tool_choice`` (app/serve/structured.py)."""
    try:
        return structured.response_format(body.get("response_format")), structured.tool_request(body, chat)
    except structured.FieldError as exc:
        raise _bad(str(exc), exc.param) from None


def _prompt_text(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("'prompt' must be one string (token arrays and several prompts are not supported)", "prompt")
    return prompt


def parse_prompt(body: dict, chat: bool) -> Prompt:
    return _messages(body) if chat else _prompt_text(body)


def count_prompt(body: dict) -> Prompt:
    """The prompt /localctx/count_tokens counts: a chat's messages with the tools its template renders."""
    chat = "messages" in body
    return structured.with_tools(parse_prompt(body, chat), _structured(body, chat)[1])


@dataclass(frozen=True)
class Number:
    """A numeric field: int or float, its inclusive range, its default when absent or null."""
    kind: type
    low: float
    high: float
    default: object = None


INT32_MAX = 2 ** 31 - 1
# Every number a request may carry, in one place: a value outside its range, not finite, or of the
# wrong kind is a 400 naming the field. The penalties are accepted as OpenAI defines them and not
# applied (no backend here has them).
NUMBERS = {
    "n": Number(int, 1, 1, 1),
    "max_tokens": Number(int, 1, INT32_MAX),
    "max_completion_tokens": Number(int, 1, INT32_MAX),
    "temperature": Number(float, 0.0, 2.0, 1.0),
    "top_p": Number(float, 0.0, 1.0, 1.0),
    "top_k": Number(int, 0, INT32_MAX, 0),
    "seed": Number(int, -2 ** 63, 2 ** 63 - 1),  # signed 64 bits, as OpenAI's API and torch take it
    "presence_penalty": Number(float, -2.0, 2.0, 0.0),
    "frequency_penalty": Number(float, -2.0, 2.0, 0.0),
}


def number(body: dict, name: str):
    """``body[name]`` checked against NUMBERS[name] (its default when absent or null)."""
    spec = NUMBERS[name]
    value = body.get(name)
    if value is None:
        return spec.default
    integral = isinstance(value, int) and not isinstance(value, bool)
    if not (integral or (spec.kind is float and isinstance(value, float))):
        raise _bad(f"'{name}' must be {'a whole number' if spec.kind is int else 'a number'}", name)
    if not math.isfinite(value) or not spec.low <= value <= spec.high:
        shown = value if math.isfinite(value) else str(value)
        raise _bad(f"'{name}' = {shown} is out of range: give {_range(spec)}", name)
    return spec.kind(value)


def _range(spec: Number) -> str:
    if spec.low == spec.high:
        return f"{spec.low:g}"
    low, high = (f"{int(v):,}" if spec.kind is int else f"{v:g}" for v in (spec.low, spec.high))
    return f"{low} to {high}"


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be true or false", name)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise _bad(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return tuple(stops)


def _stream_options(body: dict) -> bool:
    """Whether ``stream_options.include_usage`` asks for the usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    return _flag(options, "include_usage")


@dataclass(frozen=True)
class RequestRules:
    """What the operator lets a request ask for (``localctx serve`` flags)."""
    max_tokens: int = DEFAULT_MAX_TOKENS_CAP  # --max-tokens: longer answers are capped to it, and say so
    ignore_eos: bool = False  # --allow-ignore-eos: whether a request may run past end-of-text


def _max_tokens(body: dict, rules: RequestRules) -> tuple[int, int | None]:
    """(the answer's limit, what the request asked for when the server's cap lowered it, else None)."""
    asked = number(body, "max_completion_tokens")
    if asked is None:
        asked = number(body, "max_tokens")
    if asked is None:
        return min(DEFAULT_MAX_TOKENS, rules.max_tokens), None
    return (rules.max_tokens, asked) if asked > rules.max_tokens else (asked, None)


def parse(body, chat: bool, model_id: str, plan: Plan, trained_context: int,
          rules: RequestRules = RequestRules()) -> ParsedRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"The model `{model}` does not exist: this server serves only `{model_id}` "
                            "(GET /v1/models)", param="model", code="model_not_found")
    number(body, "n")
    for unused in ("presence_penalty", "frequency_penalty"):
        number(body, unused)
    constraint, tools = _structured(body, chat)
    max_tokens, asked = _max_tokens(body, rules)
    ignore_eos = _flag(body, "ignore_eos")
    if ignore_eos and not rules.ignore_eos:
        raise _bad("'ignore_eos' is off on this server (a client could make every answer run its max_tokens); "
                   "start localctx serve with --allow-ignore-eos to allow it", "ignore_eos", "ignore_eos_off")
    params = GenerationParams(
        max_tokens=max_tokens, temperature=number(body, "temperature"), top_p=number(body, "top_p"),
        top_k=number(body, "top_k"), seed=number(body, "seed"), stop=_stops(body), ignore_eos=ignore_eos,
        constraint=constraint)
    if params.top_p == 0:
        params = GenerationParams(**{**params.__dict__, "top_p": 1.0, "temperature": 0.0})
    policy, context = _extension(body.get("localctx"), plan, trained_context)
    prompt = structured.with_tools(parse_prompt(body, chat), tools)
    stream = _flag(body, "stream")
    return ParsedRequest(prompt=prompt, params=params, stream=stream,
                         include_usage=_stream_options(body) if stream else False,
                         context=context, chat=chat, policy=policy, capped_from=asked, tools=tools)


def _extension(ext, plan: Plan, trained_context: int) -> tuple[KVPolicy | None, int | None]:
    """``"localctx": {"kv": POLICY, "context": N}``: a KV policy (the scheduler finds or opens a
    lane for it, or refuses it: app/serve/lanes.py) and a context up to the served one."""
    if ext is None:
        return None, None
    if not isinstance(ext, dict):
        raise _bad("'localctx' must be an object like {\"kv\": \"int8\", \"context\": 8192}", "localctx")
    kv, policy = ext.get("kv"), None
    if kv is not None:
        try:
            policy = KVPolicy.parse(str(kv))
        except (UserError, ValueError) as exc:
            raise _bad(f"localctx.kv: {exc}", "localctx.kv") from None
    context = ext.get("context")
    if context is None:
        return policy, None
    if isinstance(context, bool) or not isinstance(context, int) or context < 16:
        raise _bad("localctx.context must be a whole number of tokens, at least 16", "localctx.context")
    if context > plan.context:
        raise _bad(f"localctx.context {context:,} is more than the server's context of {plan.context:,} tokens "
                   f"(the model's trained context is {trained_context:,}); give at most {plan.context:,}, or start "
                   f"the server with --context {min(context, trained_context)}", "localctx.context",
                   "context_unavailable")
    return policy, context


# -- responses ----------------------------------------------------------------------------------
FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "length"}


def finish_reason(event: GenerationEvent, timed_out: bool) -> str:
    return "length" if timed_out else FINISH.get(event.finish_reason or "stop", "stop")


def usage(event: GenerationEvent) -> dict:
    s = event.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
            "total_tokens": s.prompt_tokens + s.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}


def extension(event: GenerationEvent, plan: Plan, parsed: ParsedRequest, timed_out: bool) -> dict:
    """The ``localctx`` object of an answer; ``max_tokens_requested`` appears only when the server's
    --max-tokens lowered the request's limit (its ``max_tokens`` is then that cap)."""
    s, context = event.stats, parsed.context
    capped = {} if parsed.capped_from is None else {"max_tokens": parsed.params.max_tokens,
                                                    "max_tokens_requested": parsed.capped_from}
    return {**capped, "policy": s.policy, "exact": plan.exact, "kv_layout": plan.kv_layout, "kv_reserved_bytes": plan.kv_bytes,
            "kv_bytes": s.kv_bytes, "kv_tokens": s.kv_tokens,
            "evicted_tokens": s.evicted_tokens, "cached_tokens": s.cached_tokens, "shifted_tokens": s.shifted_tokens,
            "context": context or plan.context, "backend": s.backend,
            "finish": "timeout" if timed_out else event.finish_reason,
            "prefill_tok_s": round(s.prefill_tok_s, 2), "decode_tok_s": round(s.decode_tok_s, 2)}


class Ids:
    def __init__(self, chat: bool, model_id: str):
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model_id
        self.chat = chat

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def whole(ids: Ids, text: str, done: GenerationEvent, plan: Plan, parsed: ParsedRequest, timed_out: bool) -> dict:
    reason = finish_reason(done, timed_out)
    if ids.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None}
        head = ids.head("chat.completion")
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        head = ids.head("text_completion")
    return {**head, "choices": [choice], "usage": usage(done),
            "localctx": extension(done, plan, parsed, timed_out)}


def chunk(ids: Ids, text: str | None, reason: str | None = None, first: bool = False) -> dict:
    if ids.chat:
        delta: dict = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {**ids.head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}
    return {**ids.head("text_completion"),
            "choices": [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]}
