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
from localctx.kvcache.errors import UserError
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


@dataclass
class SessionRequest:
    model: str | None
    backend: str = "auto"
    kv: str | None = None
    context: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SessionRequest":
        return cls(model=args.model, backend=args.backend, kv=args.kv, context=args.context)


def resolve_model(req: SessionRequest) -> tuple[ModelRef, ModelSpec]:
    ref = resolve(req.model if req.backend != "fake" or req.model else "fake")
    spec = FAKE_SPEC if ref.kind == "fake" else read_spec(ref)
    return ref, spec


def make_plan(req: SessionRequest, spec: ModelSpec) -> Plan:
    backend = registry.auto_name() if req.backend == "auto" else req.backend
    if req.context is not None and req.context < 16:
        raise UserError(f"--context {req.context} is too small; give at least 16 tokens")
    policy = KVPolicy.parse(req.kv) if req.kv else KVPolicy()
    reason = f"KV policy {policy} from --kv" if req.kv else "full precision: exact, and it fits"
    return Plan.fixed(backend, spec, policy, req.context, reason=reason)


def open_session(req: SessionRequest) -> Session:
    ref, spec = resolve_model(req)
    plan = make_plan(req, spec)
    backend = registry.get(plan.backend)
    refusals = backend.refusals(plan.policy, spec)
    if refusals:
        raise UserError(f"backend {plan.backend} cannot run KV policy {plan.policy}: {'; '.join(refusals)}; "
                        "choose another --kv or --backend")
    return backend.load(ref, plan)
