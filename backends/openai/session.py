"""``--backend openai --endpoint URL`` (repeatable): a Session on OpenAI-compatible servers.

When a server is ``localctx serve`` (its /v1/models card carries a ``localctx`` field) the plan
is the server's own (policy, exact or lossy, KV bytes), --kv and --context pass through in each
request's ``localctx`` field, and prompts are counted by the server's tokenizer. Any other server
(llama-cpp-python, vLLM, SGLang, Ollama, LM Studio) keeps its KV policy to itself: the plan says
so, and only the portable settings pass (max_tokens, temperature, top_p, top_k, seed, stop)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from localctx.backends.base import (GenerationEvent, GenerationParams, GenerationStats, OutputConstraint,
                                    Prompt, Session)
from localctx.backends.openai.client import KEY_ENV, READ_TIMEOUT_S, Client, EndpointDown, RequestRefused
from localctx.kvcache.errors import RuntimeFailure, UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec

FOREIGN_SLOTS = 4  # requests sent at once to a server that does not say how many it decodes together
FOREIGN_CONTEXT = 2048  # llama-cpp-python's default n_ctx; give --context for a server set otherwise
BYTES_PER_TOKEN_FLOOR = 2  # token estimate for servers without a tokenizer endpoint: ≥ 2 UTF-8 bytes a token
PASSABLE = "max_tokens, temperature, top_p, top_k, seed, stop"


@dataclass
class Endpoint:
    url: str
    client: Client
    model: str
    card: dict  # the server's /v1/models entry for the model
    slots: int = FOREIGN_SLOTS
    failures: int = 0  # consecutive failures (connection errors, 5xx)
    dead: bool = False

    @property
    def localctx(self) -> dict | None:
        ext = self.card.get("localctx")
        return ext if isinstance(ext, dict) else None

    def free_slots(self) -> int:
        """Free capacity now: localctx serve says it on /health; others get their nominal slots."""
        if self.localctx is None:
            return self.slots
        try:
            return int(self.client.get("/health", timeout=3.0).get("free", 0))
        except (EndpointDown, RequestRefused, ValueError, TypeError):
            return 0


def discover(url: str, model: str | None, timeout_s: float = READ_TIMEOUT_S) -> Endpoint:
    client = Client.for_url(url, timeout_s)
    try:
        listing = client.get("/v1/models")
    except EndpointDown as exc:
        raise UserError(f"cannot reach the endpoint {url} ({exc}); start the server or fix --endpoint") from None
    except RequestRefused as exc:
        hint = f"; set ${KEY_ENV} to the server's key" if exc.status in (401, 403) else ""
        raise UserError(f"{url} refused /v1/models ({exc}){hint}") from None
    cards = [c for c in listing.get("data") or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
    if not cards:
        raise UserError(f"{url} lists no models on /v1/models; is it an OpenAI-compatible server?")
    if model:
        chosen = next((c for c in cards if c["id"] == model), None)
        if chosen is None:
            raise UserError(f"{url} does not serve {model!r}; it serves {', '.join(c['id'] for c in cards)} "
                            "(give one with -m, or omit -m)")
    else:
        chosen = cards[0]
    ext = chosen.get("localctx")
    slots = int(ext.get("slots", 1)) if isinstance(ext, dict) else FOREIGN_SLOTS
    return Endpoint(url=url, client=client, model=chosen["id"], card=chosen, slots=max(1, slots))


@dataclass(frozen=True)
class RemoteRequest:
    endpoints: tuple[str, ...]
    model: str | None = None
    kv: str | None = None
    context: int | None = None
    timeout_s: float = READ_TIMEOUT_S  # --timeout: the longest wait for the server's next bytes


def remote_plan(endpoints: list[Endpoint], req: RemoteRequest) -> tuple[Plan, ModelSpec, dict | None]:
    """The plan the first endpoint runs, and the ``localctx`` extension to send (None: none)."""
    first = endpoints[0]
    names = ", ".join(e.url for e in endpoints)
    ext = first.localctx
    if any((e.localctx is None) != (ext is None) for e in endpoints):
        raise UserError(f"the endpoints {names} mix localctx serve with other servers; give one kind")
    if ext is None:
        if req.kv:
            raise UserError(f"{first.url} is not localctx serve: its KV policy is its own; drop --kv and set KV "
                            "options on that server (e.g. llama.cpp --cache-type-k q8_0, vLLM --kv-cache-dtype fp8)")
        context = req.context or int(first.card.get("max_model_len") or 0) or FOREIGN_CONTEXT
        reasons = [f"the KV policy is the server's ({names} is not localctx serve); localctx passes {PASSABLE}",
                   f"context {context:,} tokens: " + ("--context as given" if req.context else
                                                      "the server's max_model_len" if first.card.get("max_model_len")
                                                      else f"assumed ({FOREIGN_CONTEXT:,}, llama.cpp's default); "
                                                           "give --context to match the server"),
                   "prompt tokens are estimated here (no tokenizer on the server's API)"]
        plan = Plan(backend="openai", policy=KVPolicy.parse("fp16"), context=context, kv_bytes=0,
                    hardware=f"remote: {names}", reasons=reasons,
                    kv_layout="the server's own KV cache: localctx cannot see or set it")
        spec = _spec(first.model, int(first.card.get("max_model_len") or context))
        return plan, spec, None
    served = ext.get("plan") or {}
    policy = KVPolicy.parse(str(served.get("policy", "fp16")))
    if req.kv and str(KVPolicy.parse(req.kv)) != str(policy):
        return _lane_plan(endpoints, req, ext)
    context = min(int((e.localctx or {}).get("context", 0)) for e in endpoints)
    if req.context and req.context > context:
        raise UserError(f"--context {req.context:,} is more than {first.url} holds ({context:,}); give at most that")
    context = req.context or context
    plan = Plan(backend="openai", policy=policy, context=context, kv_bytes=int(served.get("kv_bytes", 0)),
                weight_bytes=int(served.get("weight_bytes", 0)), decode_tok_s=served.get("decode_tok_s"),
                prefill_tok_s=served.get("prefill_tok_s"), hardware=f"remote: {names}",
                kv_layout=str(served.get("kv_layout", "")),
                reasons=[f"planned by localctx serve at {first.url} (backend {served.get('backend')})",
                         *[str(r) for r in served.get("reasons", [])]])
    send = {"kv": str(policy), **({"context": req.context} if req.context else {})}
    return plan, _spec(first.model, int(ext.get("trained_context") or context)), send


def _lane_plan(endpoints: list[Endpoint], req: RemoteRequest, ext: dict) -> tuple[Plan, ModelSpec, dict]:
    """--kv other than the server's plan: localctx serve runs it in a lane of its own on the same
    weights, within its plan's KV budget (docs/serve.md), or refuses it with the reason when asked."""
    first, names = endpoints[0], ", ".join(e.url for e in endpoints)
    served = ext.get("plan") or {}
    policy = KVPolicy.parse(req.kv)
    context = min(int((e.localctx or {}).get("context", 0)) for e in endpoints)
    if req.context and req.context > context:
        raise UserError(f"--context {req.context:,} is more than {first.url} holds ({context:,}); give at most that")
    context = req.context or context
    budget = int(ext.get("kv_budget") or served.get("kv_bytes") or 0)
    plan = Plan(backend="openai", policy=policy, context=context, kv_bytes=0, hardware=f"remote: {names}",
                kv_layout="the server's lane for this policy (its layout and KV bytes come with each answer)",
                reasons=[f"KV policy {policy} from --kv: localctx serve at {first.url} runs it in a lane beside its "
                         f"plan ({served.get('policy')}), within that plan's KV budget of {budget:,} bytes, or "
                         "refuses it with the reason"])
    send = {"kv": str(policy), **({"context": req.context} if req.context else {})}
    return plan, _spec(first.model, int(ext.get("trained_context") or context)), send


def _spec(name: str, trained: int) -> ModelSpec:
    # a remote model's shape is not known here; the surfaces use its name and trained context only
    return ModelSpec(name=name, architecture="remote", n_layers=0, n_heads=0, n_kv_heads=0, head_dim=0,
                     hidden_size=0, vocab_size=0, context_length=trained)


@dataclass
class _Clock:
    started: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    generated: int = 0


class RemoteSession(Session):
    backend_name = "openai"
    decode_threads = 0  # the server decodes

    def __init__(self, endpoints: list[Endpoint], req: RemoteRequest):
        self.endpoints = endpoints
        self.plan, self.spec, self.extension = remote_plan(endpoints, req)
        self.model = endpoints[0].model

    @property
    def is_localctx(self) -> bool:
        return self.extension is not None

    # -- prompts ----------------------------------------------------------------------------
    def count_tokens(self, prompt: Prompt) -> int:
        if self.is_localctx:
            body = {"prompt": prompt} if isinstance(prompt, str) else {"messages": list(prompt)}
            for endpoint in self.alive():
                try:
                    return int(endpoint.client.post("/localctx/count_tokens", body, timeout=30.0)["count"])
                except EndpointDown:
                    continue
                except (RequestRefused, KeyError, ValueError) as exc:
                    raise RuntimeFailure(f"{endpoint.url} could not count tokens: {exc}") from None
            raise RuntimeFailure("no endpoint answers: " + ", ".join(e.url for e in self.endpoints))
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN_FLOOR) + (0 if isinstance(prompt, str) else 8 * len(prompt))

    def constraint_refusal(self, constraint: OutputConstraint) -> str | None:
        """The server enforces it: one JSON schema goes as ``response_format`` (a server without
        structured output may ignore it; localctx serve enforces it)."""
        if len(constraint.shapes) != 1 or constraint.shapes[0].prefix or constraint.shapes[0].suffix:
            return f"{constraint.field}: the openai backend sends one JSON schema as response_format, not a grammar"
        return None

    def alive(self) -> list[Endpoint]:
        """The endpoints not marked dead, in the order they were given."""
        return [e for e in self.endpoints if not e.dead]

    def body(self, prompt: Prompt, params: GenerationParams, stream: bool) -> tuple[str, dict]:
        body: dict = {"model": self.model, "max_tokens": params.max_tokens, "temperature": params.temperature,
                      "top_p": params.top_p, "stream": stream}
        if params.top_k:
            body["top_k"] = params.top_k
        if params.seed is not None:
            body["seed"] = params.seed
        if params.ignore_eos:  # vLLM's, llama.cpp's and localctx's servers take it; sent only when asked for
            body["ignore_eos"] = True
        if params.stop:
            body["stop"] = list(params.stop)
        if params.constraint is not None:  # one bare schema (constraint_refusal): OpenAI's structured output
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": json.loads(params.constraint.shapes[0].schema), "strict": True}}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.extension:
            body["localctx"] = dict(self.extension)
        if isinstance(prompt, str):
            return "/v1/completions", {**body, "prompt": prompt}
        return "/v1/chat/completions", {**body, "messages": [dict(m) for m in prompt]}

    def stats(self, usage: dict | None, ext: dict | None, clock: _Clock) -> GenerationStats:
        usage, ext = usage or {}, ext or {}
        now = time.perf_counter()
        first = clock.first or now
        return GenerationStats(
            backend="openai", policy=str(ext.get("policy") or self.plan.policy) if self.is_localctx else "server's",
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0),
            generated_tokens=int(usage.get("completion_tokens", clock.generated)),
            prefill_s=first - clock.started, decode_s=max(0.0, (clock.last or first) - first),
            kv_bytes=int(ext.get("kv_bytes", 0)), kv_tokens=int(ext.get("kv_tokens", 0)),
            evicted_tokens=int(ext.get("evicted_tokens", 0)))

    def whole_answer_stats(self, usage: dict | None, ext: dict | None) -> GenerationStats:
        """The stats of an answer that came back whole (not streamed): its text arrived at once, now."""
        clock = _Clock()
        clock.first = clock.last = time.perf_counter()
        return self.stats(usage, ext, clock)

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: GenerationParams = GenerationParams(),
                 cancel: threading.Event | None = None) -> Iterator[GenerationEvent]:
        path, body = self.body(prompt, params, stream=True)
        errors = []
        for endpoint in self.alive():
            clock = _Clock()
            try:
                yield from self._stream(endpoint, path, body, clock, cancel)
                return
            except EndpointDown as exc:
                if clock.generated:  # text already went out: resending would repeat it
                    raise RuntimeFailure(f"{endpoint.url} failed mid-answer: {exc}") from None
                errors.append(str(exc))
            except RequestRefused as exc:
                raise UserError(f"the server refused the request: {exc}") from None
        raise RuntimeFailure("no endpoint answered: " + "; ".join(errors))

    def _stream(self, endpoint: Endpoint, path: str, body: dict, clock: _Clock,
                cancel: threading.Event | None) -> Iterator[GenerationEvent]:
        finish, usage, ext = None, None, None
        chunks = endpoint.client.stream(path, body)
        try:
            for item in chunks:
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                usage = item.get("usage") or usage
                ext = item.get("localctx") or ext
                for choice in item.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        clock.first = clock.first or now
                        clock.last = now
                        clock.generated += 1
                        yield GenerationEvent("token", self.stats(None, None, clock), text=text)
                    finish = choice.get("finish_reason") or finish
        finally:
            chunks.close()
        yield GenerationEvent("done", self.stats(usage, ext, clock), finish_reason=finish or "stop")

    def generate_batch(self, prompts: Sequence[Prompt], params: GenerationParams = GenerationParams(),
                       cancel: threading.Event | None = None) -> Iterator[tuple[int, GenerationEvent]]:
        from localctx.backends.openai.pool import run_spread  # several endpoints, several requests each

        return run_spread(self, list(prompts), params, cancel)

    @property
    def total_slots(self) -> int:
        return sum(e.slots for e in self.alive())


def open_remote(req: RemoteRequest) -> RemoteSession:
    if not req.endpoints:
        raise UserError("--backend openai needs --endpoint URL (repeatable), e.g. --endpoint http://127.0.0.1:8080")
    endpoints = [discover(url, req.model, req.timeout_s) for url in req.endpoints]
    models = {e.model for e in endpoints}
    if len(models) > 1:
        raise UserError(f"the endpoints serve different models ({', '.join(sorted(models))}); give -m to pick one")
    return RemoteSession(endpoints, req)


def remote_ref_path(model: str) -> Path:
    return Path(model.replace("/", "_"))


def describe_remote(req: RemoteRequest, as_json: bool) -> int:
    """``localctx plan --backend openai``: whose plan it is, and what localctx can still set."""
    import json

    session = open_remote(req)
    plan = session.plan
    info = {"backend": "openai", "endpoints": [e.url for e in session.endpoints], "model": session.model,
            "server_is_localctx": session.is_localctx,
            "kv_policy": str(plan.policy) if session.is_localctx else "the server's",
            "passes": (["kv", "context", *PASSABLE.split(", ")] if session.is_localctx else PASSABLE.split(", ")),
            "plan": plan.to_dict()}
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model     {session.model} on {', '.join(info['endpoints'])}")
    if session.is_localctx:
        print(f"policy    {plan.policy}  ({plan.kv_layout}), planned by localctx serve")
    else:
        print("policy    the server's: localctx cannot see or set its KV cache")
    print(f"context   {plan.context:,} tokens")
    print(f"passes    {', '.join(info['passes'])}")
    print("\nwhy:")
    for reason in plan.reasons:
        print(f"  - {reason}")
    return 0
