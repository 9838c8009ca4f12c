"""Options every model-running command shares (-m, --backend, --kv, --context) and how they
turn into a plan and a loaded session."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from localctx.backends import registry
from localctx.backends.base import Session
from localctx.backends.model_spec import read_spec
from localctx.backends.modelref import ModelRef, resolve
from localctx.backends.fake import FAKE_SPEC
from localctx.backends.planning import PlanningContext, make_auto_plan, plan_fixed, planning_context
from localctx.kvcache.errors import UserError
from localctx.kvcache.planner import PlanRequest, parse_size
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.spec import ModelSpec


def add_session_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", default=None,
                        help="GGUF path, HF folder, hub repo id, or omit for the bundled SmolLM2-135M")
    parser.add_argument("--backend", default="auto", help="llamacpp, torch, mlx or auto (default)")
    parser.add_argument("--kv", default=None, metavar="POLICY",
                        help="KV policy, e.g. fp16, int8, int4+res128, int4+sink4+win4096 (default: planned)")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="tokens the session holds (default: the model's trained context)")
    parser.add_argument("--min-tok-s", type=float, default=None, metavar="N",
                        help="decode speed target: the plan keeps decode at or above N tok/s")
    parser.add_argument("--exact", action="store_true",
                        help="only exact KV plans (full precision, nothing evicted)")
    parser.add_argument("--max-memory", default=None, metavar="SIZE",
                        help="cap on weights + KV + runtime, e.g. 6GB or 800MiB (default: free memory)")


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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SessionRequest":
        return cls(model=args.model, backend=args.backend, kv=args.kv, context=args.context,
                   min_tok_s=args.min_tok_s, exact=args.exact, max_memory=args.max_memory)

    def plan_request(self) -> PlanRequest:
        return PlanRequest(context=self.context, min_tok_s=self.min_tok_s, exact=self.exact,
                           max_memory=parse_size(self.max_memory) if self.max_memory else None, heavy=self.heavy)


def resolve_model(req: SessionRequest) -> tuple[ModelRef, ModelSpec]:
    ref = resolve(req.model if req.backend != "fake" or req.model else "fake")
    spec = FAKE_SPEC if ref.kind == "fake" else read_spec(ref)
    return ref, spec


def make_plan(req: SessionRequest, spec: ModelSpec, ctx: PlanningContext | None = None) -> Plan:
    """The planner's choice for this model on this machine (or ``req.hardware``), unless ``--kv``
    names a policy; either way a plan that cannot fit is refused here, before loading."""
    if req.context is not None and req.context < 16:
        raise UserError(f"--context {req.context} is too small; give at least 16 tokens")
    if req.kv and (req.exact or req.min_tok_s):
        raise UserError("--kv names the policy itself; drop --exact / --min-tok-s, or drop --kv to let localctx plan")
    if ctx is None:
        ctx = planning_context(req.backend, spec, hardware=req.hardware, measure=req.backend != "fake")
    plan = plan_fixed(ctx, spec, KVPolicy.parse(req.kv), req.plan_request()) if req.kv else \
        make_auto_plan(ctx, spec, req.plan_request())
    if req.backend == "fake":
        plan.hardware = ""  # the fake backend runs on no hardware: surfaces show their own label
    return plan


@dataclass(frozen=True)
class PlannedSession:
    """A model resolved and planned, not loaded yet: load() does the slow part."""
    ref: ModelRef
    spec: ModelSpec
    plan: Plan

    def load(self) -> Session:
        return registry.get(self.plan.backend).load(self.ref, self.plan)


def plan_session(req: SessionRequest) -> PlannedSession:
    """Resolves and plans; a bad model, policy or backend is refused here, before anything loads."""
    ref, spec = resolve_model(req)
    plan = make_plan(req, spec)
    refusals = registry.get(plan.backend).refusals(plan.policy, spec)
    if refusals:
        raise UserError(f"backend {plan.backend} cannot run KV policy {plan.policy}: {'; '.join(refusals)}; "
                        "choose another --kv or --backend")
    return PlannedSession(ref, spec, plan)


def open_session(req: SessionRequest) -> Session:
    return plan_session(req).load()
