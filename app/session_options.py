"""Options every model-running command shares (-m, --backend, --kv, --context) and how they
turn into a plan and a loaded session."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from localctx.app.startup_timings import Stopwatch
from localctx.backends import registry
from localctx.backends.base import Session
from localctx.backends.models.spec_reader import read_spec
from localctx.backends.models.ref import ModelRef, resolve
from localctx.backends.machine.planner_inputs import PlanningContext, make_auto_plan, plan_fixed, planning_context
from localctx.kvcache import cost, quality_calibration
from localctx.kvcache.errors import UserError
from localctx.kvcache.kld_quality import CALIBRATED_BACKENDS, DEFAULT_MAX_KLD
from localctx.kvcache.planner import PlanRequest, parse_size
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """-m/--model: every command that loads or plans a model takes it (run, chat, summarize, plan, serve, eval,
    bench)."""
    parser.add_argument("-m", "--model", default=None,
                        help="GGUF path, HF folder, hub repo id, or omit for the bundled SmolLM2-135M")


def add_session_options(parser: argparse.ArgumentParser, remote: bool = True) -> None:
    """The options of a command that plans and opens one session: -m, --backend, the plan's options
    (--kv, --context, --min-tok-s, --exact, --max-memory) and, with ``remote``, the openai backend's
    --endpoint and --timeout. ``localctx serve`` runs a local model: remote=False, and it reads them with
    SessionRequest.from_local_args."""
    add_model_option(parser)
    parser.add_argument("--backend", default="auto",
                        help="llamacpp, torch, mlx, auto (default), or openai (a server: give --endpoint)" if remote
                        else "llamacpp, torch, mlx or auto (default)")
    if remote:
        parser.add_argument("--endpoint", action="append", default=[], metavar="URL",
                            help="with --backend openai: an OpenAI-compatible server (repeatable; key from "
                                 "$LOCALCTX_OPENAI_API_KEY)")
        parser.add_argument("--timeout", type=float, default=None, metavar="S",
                            help="with --backend openai: seconds to wait for the server's next bytes before "
                                 "giving up with an error (default 600)")
    parser.add_argument("--kv", default=None, metavar="POLICY",
                        help="KV policy, e.g. fp16, int8, int4+res128, int4+sink4+win4096 (default: planned)")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="tokens the session may hold (default: the model's trained context); run allocates "
                             "what its request needs unless N is more, chat starts small and grows up to N, serve "
                             "starts small and grows up to N")
    parser.add_argument("--min-tok-s", type=float, default=None, metavar="N",
                        help="decode speed target: the plan keeps decode at or above N tok/s")
    parser.add_argument("--exact", action="store_true",
                        help="only exact KV plans (full precision, nothing evicted)")
    parser.add_argument("--max-memory", default=None, metavar="SIZE",
                        help="cap on weights + KV + runtime, e.g. 6GB or 800MiB (default: free memory)")
    parser.add_argument("--max-kld", type=float, default=DEFAULT_MAX_KLD, metavar="NATS",
                        help="quality budget: never plan a KV format whose mean KL divergence from full precision "
                             f"on this model exceeds NATS per token (default {DEFAULT_MAX_KLD:g}; measured by "
                             "localctx plan --calibrate-quality, else a prior)")


@dataclass
class SessionRequest:
    model: str | None
    backend: str = "auto"
    kv: str | None = None
    context: int | None = None
    min_tok_s: float | None = None
    exact: bool = False
    max_memory: str | None = None
    hardware: str | None = None  # a named profile to plan for (localctx plan --hardware); None = this machine
    heavy: bool = False  # let the planner consider heavy-hitter eviction (localctx plan --heavy)
    endpoints: tuple[str, ...] = ()  # --backend openai: the servers
    prompt_cache: bool = False  # keep long prompts' KV on disk (run, chat, summarize)
    cache_reuse: int = 0  # llama.cpp: move cached runs of at least this many tokens into place (0: off)
    timeout: float | None = None  # --backend openai: seconds to wait for the server's next bytes
    # tokens to allocate KV for at load (the session grows toward the plan's context); None: all of it.
    # --context, where given, is allocated whole, unless ``grow_to_context`` (serve: it is the most the KV grows to).
    allocate: int | None = None
    grow_to_context: bool = False
    max_kld: float = DEFAULT_MAX_KLD  # the planner's quality budget (kvcache/kld_quality.py)

    @classmethod
    def from_local_args(cls, args: argparse.Namespace, prompt_cache: bool = False,
                        cache_reuse: int = 0) -> "SessionRequest":
        """The options add_session_options(remote=False) adds."""
        return cls(model=args.model, backend=args.backend, kv=args.kv, context=args.context,
                   min_tok_s=args.min_tok_s, exact=args.exact, max_memory=args.max_memory,
                   prompt_cache=prompt_cache, cache_reuse=cache_reuse, max_kld=args.max_kld)

    @classmethod
    def from_args(cls, args: argparse.Namespace, prompt_cache: bool = False, cache_reuse: int = 0) -> "SessionRequest":
        """The options add_session_options() adds: the local ones and --endpoint, --timeout."""
        local = cls.from_local_args(args, prompt_cache, cache_reuse)
        return replace(local, endpoints=tuple(args.endpoint), timeout=args.timeout)

    def plan_request(self) -> PlanRequest:
        return PlanRequest(context=self.context, min_tok_s=self.min_tok_s, exact=self.exact,
                           max_memory=parse_size(self.max_memory) if self.max_memory else None, heavy=self.heavy,
                           max_kld=self.max_kld)


def remote_request(req: SessionRequest):
    from localctx.backends.openai.session import RemoteRequest

    if req.exact or req.min_tok_s or req.max_memory:
        raise UserError("--exact, --min-tok-s and --max-memory plan a local model; with --backend openai the "
                        "server plans (localctx serve) or keeps its own settings")
    if req.timeout is not None and req.timeout <= 0:
        raise UserError(f"--timeout {req.timeout} must be more than 0 seconds")
    return RemoteRequest(endpoints=req.endpoints, model=req.model, kv=req.kv, context=req.context,
                         **({"timeout_s": req.timeout} if req.timeout else {}))


def resolve_model(req: SessionRequest, watch: Stopwatch | None = None) -> tuple[ModelRef, ModelSpec]:
    if req.backend == "openai":
        from localctx.backends.openai.session import open_remote, remote_ref_path

        session = open_remote(remote_request(req))
        return ModelRef("remote", remote_ref_path(session.model), session.model, "endpoint"), session.spec
    if req.endpoints:
        raise UserError("--endpoint is for --backend openai; add --backend openai or drop --endpoint")
    if req.timeout is not None:
        raise UserError("--timeout bounds the wait for a server (--backend openai); a local model has none to "
                        "bound: drop --timeout")
    watch = watch or Stopwatch()
    ref = resolve(req.model if req.backend != "fake" or req.model else "fake")
    watch.lap("model file")
    if ref.kind == "fake":
        from localctx.backends.fake.session import FAKE_SPEC

        spec = FAKE_SPEC
    else:
        spec = read_spec(ref)
    watch.lap("header")
    return ref, spec


def check_plan_options(req: SessionRequest) -> None:
    if req.context is not None and req.context < 16:
        raise UserError(f"--context {req.context} is too small; give at least 16 tokens")
    if req.kv and (req.exact or req.min_tok_s):
        raise UserError("--kv names the policy itself; drop --exact / --min-tok-s, or drop --kv to let localctx plan")


def make_planning_context(req: SessionRequest, spec: ModelSpec, ref: ModelRef | None = None) -> PlanningContext:
    """This machine (its profile measured once and cached) or ``req.hardware``, and the backend's view;
    ``ref``'s file names the quality calibration the planner judges formats by (kvcache/quality_calibration.py)."""
    return planning_context(req.backend, spec, hardware=req.hardware, measure=req.backend != "fake",
                            model_file=model_file(ref))


def make_plan(req: SessionRequest, spec: ModelSpec, ctx: PlanningContext | None = None,
              ref: ModelRef | None = None) -> Plan:
    """The planner's choice for this model on this machine (or ``req.hardware``), unless ``--kv``
    names a policy; either way a plan that cannot fit is refused here, before loading. With
    --backend openai the plan is the server's (backends/openai/session.py)."""
    if req.backend == "openai":
        from localctx.backends.openai.session import open_remote

        return open_remote(remote_request(req)).plan
    check_plan_options(req)
    if ctx is None:
        ctx = make_planning_context(req, spec, ref)
    plan = plan_fixed(ctx, spec, KVPolicy.parse(req.kv), req.plan_request()) if req.kv else \
        make_auto_plan(ctx, spec, req.plan_request())
    if req.kv:  # a policy the user named is refused by plan as by run, with the backend's reason
        refuse_unrunnable(plan, spec)
    if req.backend == "fake":
        plan.hardware = ""  # the fake backend runs on no hardware: surfaces show their own label
    return plan


def model_file(ref: ModelRef | None):
    """The file (or folder) a calibration is cached for: a local model's, None for the others."""
    return ref.path if ref is not None and ref.kind in ("gguf", "hf") else None


def add_prompt_cache_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                        help="neither read nor write the KV of long prompts on disk (localctx cache ls)")


def add_cache_reuse_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                        help="llama.cpp, fp16 KV: when a message is removed from the middle of a conversation, "
                             "keep the cached runs of at least N tokens after it, moved into place (lossy: their KV "
                             "was computed with the removed text before them); 0 = off (default)")


def check_cache_reuse(n: int) -> int:
    if n < 0:
        raise UserError(f"--cache-reuse {n} must be 0 (off) or a run length in tokens, e.g. 64")
    return n


@dataclass(frozen=True)
class PlannedSession:
    """A model resolved and planned, not loaded yet: load() does the slow part."""
    ref: ModelRef
    spec: ModelSpec
    plan: Plan
    prompt_cache: bool = False  # keep long prompts' KV on disk
    cache_reuse: int = 0  # llama.cpp's shift-based chunk reuse, runs of at least this many tokens (0: off)
    opened: Session | None = None  # --backend openai: the remote session planning already opened

    def load(self, watch: Stopwatch | None = None) -> Session:
        if self.opened is not None:
            return self.opened
        watch = watch or Stopwatch()
        session = registry.get(self.plan.backend).load(self.ref, self.plan)
        watch.lap("load")
        for part, seconds in session.load_parts.items():
            watch.split("load", part, seconds)
        if self.prompt_cache and self.ref.kind != "fake":
            session.enable_prompt_cache(self.ref.path)  # a backend without one just says why; nothing to tell here
        if self.cache_reuse:
            reason = session.enable_cache_reuse(self.cache_reuse)
            if reason:
                session.close()
                raise UserError(f"--cache-reuse does not apply: {reason}; drop --cache-reuse")
        watch.lap("prompt cache")
        return session


def refuse_unrunnable(plan: Plan, spec: ModelSpec) -> None:
    refusals = registry.get(plan.backend).refusals(plan.policy, spec)
    if refusals:
        raise UserError(f"backend {plan.backend} cannot run KV policy {plan.policy}: {'; '.join(refusals)}; "
                        "choose another --kv or --backend")


GROW_FROM_TOKENS = 4096  # a conversation's first allocation (chat): it doubles as the conversation grows
# a server's first allocation per slot (serve: --parallel times this): a prompt of up to 512 tokens and an answer
# of the API's default 512 (app/serve/protocol.DEFAULT_MAX_TOKENS) fit without growing; it doubles from there
SLOT_GROW_FROM_TOKENS = 1024


def size_plan(plan: Plan, req: SessionRequest, spec: ModelSpec) -> Plan:
    """The plan allocating ``req.allocate`` tokens at load (or --context, where that is more and the request
    does not grow to it: ``grow_to_context``), in the backend's
    cells and its own bytes; the plan's context stays the maximum the session grows to."""
    if req.allocate is None:
        return plan
    cls = registry.backend_class(plan.backend)
    backend = cls() if cls is not None else None
    if backend is not None and not backend.kv_reserved_at_load:
        return plan  # nothing to size: the session says what its buffers take as they fill
    allocation = (backend.kv_allocation() if backend is not None else None) or cost.max_kv_bytes
    cell = backend.kv_cell_tokens if backend is not None else 1
    first = req.allocate if req.grow_to_context else max(req.allocate, req.context or 0)
    return plan.sized_to(first, cell, lambda n: allocation(spec, plan.policy, n))


def plan_session(req: SessionRequest, watch: Stopwatch | None = None) -> PlannedSession:
    """Resolves and plans; a bad model, policy or backend is refused here, before anything loads.
    With --backend openai the servers are asked here, and load() hands back that remote session.
    ``watch`` times the stages (run --timings)."""
    watch = watch or Stopwatch()
    if req.backend == "openai":
        from localctx.backends.openai.session import open_remote, remote_ref_path

        remote = open_remote(remote_request(req))
        ref = ModelRef("remote", remote_ref_path(remote.model), remote.model, "endpoint")
        watch.lap("remote plan")
        return PlannedSession(ref, remote.spec, remote.plan, opened=remote)
    ref, spec = resolve_model(req, watch)
    check_plan_options(req)
    ctx = make_planning_context(req, spec, ref)
    watch.lap("machine and backend profile")
    plan = size_plan(make_plan(req, spec, ctx, ref=ref), req, spec)
    watch.lap("plan")
    refuse_unrunnable(plan, spec)
    watch.lap("engine import and check")
    if check_cache_reuse(req.cache_reuse) and plan.backend != "llamacpp":  # before a model loads for nothing
        raise UserError(f"--cache-reuse is llama.cpp's shift-based chunk reuse and the plan runs on {plan.backend}; "
                        "add --backend llamacpp or drop --cache-reuse")
    return PlannedSession(ref, spec, plan, req.prompt_cache, req.cache_reuse)


QUALITY_CALIBRATED = CALIBRATED_BACKENDS  # the backends `plan --calibrate-quality` measures


def calibration_offer(planned: PlannedSession) -> str | None:
    """One line offering ``localctx plan --calibrate-quality`` the first time a lossy plan is chosen for
    a model whose quality on that backend is not measured (None otherwise, and every later time)."""
    plan, path = planned.plan, model_file(planned.ref)
    if plan.exact or path is None or plan.backend not in QUALITY_CALIBRATED:
        return None
    if (plan.quality or {}).get("basis") == "measured" or not quality_calibration.offer_once(path, plan.backend):
        return None
    judged = "a prior from other models" if plan.quality else "no KL divergence figure for it"
    return (f"note: KV {plan.policy} is lossy and its cost on {planned.spec.name} is not measured ({judged}); "
            f"measure it once: localctx plan --calibrate-quality -m {path} --backend {plan.backend}")


def open_session(req: SessionRequest, watch: Stopwatch | None = None) -> Session:
    if req.backend == "openai":
        from localctx.backends.openai.session import open_remote

        return open_remote(remote_request(req))
    return plan_session(req, watch).load(watch)
