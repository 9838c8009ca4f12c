"""OpenAI's request and response shapes: parsing a request body into a prompt, generation
parameters and the ``localctx`` extension; building completions, chunks and errors.

Unknown fields are ignored, as OpenAI-compatible servers do; nothing in a request can name a
file or another model (``model`` must be the served model's id, or absent)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from localctx.backends.base import GenerationEvent, GenerationParams, Prompt
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy

DEFAULT_MAX_TOKENS = 512
MAX_STOPS = 4
ROLES = ("system", "user", "assistant", "developer")


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


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


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
        out.append({"role": role, "content": _content(m.get("content"), i)})
    return out


def _prompt_text(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("'prompt' must be one string (token arrays and several prompts are not supported)", "prompt")
    return prompt


def parse_prompt(body: dict, chat: bool) -> Prompt:
    return _messages(body) if chat else _prompt_text(body)


def _number(body: dict, name: str, kind, low: float | None, high: float | None, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise _bad(f"'{name}' must be a number", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise _bad(f"'{name}' = {value} is out of range [{low}, {high}]", name)
    return kind(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
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


def parse(body: dict, chat: bool, model_id: str, plan: Plan, trained_context: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"The model `{model}` does not exist: this server serves only `{model_id}` "
                            "(GET /v1/models)", param="model", code="model_not_found")
    if _number(body, "n", int, 1, 1, 1) != 1:
        raise _bad("'n' must be 1", "n")
    max_tokens = _number(body, "max_completion_tokens", int, 1, None, None)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int, 1, None, DEFAULT_MAX_TOKENS)
    params = GenerationParams(
        max_tokens=max_tokens, temperature=_number(body, "temperature", float, 0, 2, 1.0),
        top_p=_number(body, "top_p", float, 0, 1, 1.0), top_k=_number(body, "top_k", int, 0, None, 0),
        seed=_number(body, "seed", int, None, None, None), stop=_stops(body), ignore_eos=_flag(body, "ignore_eos"))
    if params.top_p == 0:
        params = GenerationParams(**{**params.__dict__, "top_p": 1.0, "temperature": 0.0})
    options = body.get("stream_options") or {}
    policy, context = _extension(body.get("localctx"), plan, trained_context)
    prompt = parse_prompt(body, chat)
    return ParsedRequest(prompt=prompt, params=params, stream=bool(body.get("stream")),
                         include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
                         context=context, chat=chat, policy=policy)


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


def extension(event: GenerationEvent, plan: Plan, context: int | None, timed_out: bool) -> dict:
    s = event.stats
    return {"policy": s.policy, "exact": plan.exact, "kv_layout": plan.kv_layout, "kv_reserved_bytes": plan.kv_bytes,
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


def whole(ids: Ids, text: str, done: GenerationEvent, plan: Plan, context: int | None, timed_out: bool) -> dict:
    reason = finish_reason(done, timed_out)
    if ids.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None}
        head = ids.head("chat.completion")
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        head = ids.head("text_completion")
    return {**head, "choices": [choice], "usage": usage(done),
            "localctx": extension(done, plan, context, timed_out)}


def chunk(ids: Ids, text: str | None, reason: str | None = None, first: bool = False) -> dict:
    if ids.chat:
        delta: dict = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {**ids.head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}
    return {**ids.head("text_completion"),
            "choices": [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]}
