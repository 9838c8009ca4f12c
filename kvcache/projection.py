"""What a plan's policy holds and decodes at other context lengths (`localctx plan`'s projection table):
KV bytes as the backend allocates them and the speed model's decode rate, at 4K / 32K / 128K and the
request."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.plan import Plan
from localctx.kvcache.planner import BackendView
from localctx.kvcache.speed import SpeedModel


@dataclass(frozen=True)
class Projection:
    context: int
    kv_bytes: int
    decode_tok_s: float
    fits: bool


def projections(p: Plan, spec: ModelSpec, speed: SpeedModel, contexts: list[int], kv_budget: int,
                backend: BackendView | None = None) -> list[Projection]:
    """KV memory (as ``backend`` allocates it) and decode speed of the chosen policy at each context length."""
    view = backend or BackendView(p.backend, lambda policy: [])
    out = []
    for c in contexts:
        kv = view.kv_bytes(spec, p.policy, c)
        out.append(Projection(c, kv, speed.worst_decode_tok_s(spec, p.policy, c), kv <= kv_budget))
    return out


def projection_contexts(spec: ModelSpec, requested: int) -> list[int]:
    """4K / 32K / 128K up to the trained context (and past it only if asked), plus the request."""
    top = max(spec.context_length, requested)
    out = sorted({c for c in (4096, 32768, 131072) if c <= top} | {requested})
    return out
