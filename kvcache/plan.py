"""Plan: what the planner chose, what it projects, and why (docs/architecture.md "Core types")."""
from __future__ import annotations

from dataclasses import dataclass, field

from localctx.kvcache import cost
from localctx.kvcache.eviction import policy_cache_layout
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec


@dataclass(frozen=True)
class Rejected:
    backend: str
    policy: str
    reason: str
    quality: dict | None = None  # the format's KL divergence figure (kvcache/kld_quality.py), if any


@dataclass
class Plan:
    backend: str
    policy: KVPolicy
    context: int  # tokens the session accepts (prompt + answer); for windowed policies a stream may go past it
    kv_bytes: int  # projected peak KV bytes at ``context`` tokens
    weight_bytes: int = 0
    decode_tok_s: float | None = None  # projected at ``context``
    prefill_tok_s: float | None = None
    hardware: str = ""
    reasons: list[str] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    kv_layout: str = ""  # what the backend's cache holds for ``policy``, in words (Backend.describe_kv)
    quality: dict | None = None  # the chosen format's KL divergence figure, measured or prior (kvcache/kld_quality.py)

    def __post_init__(self) -> None:
        if not self.kv_layout:  # a plan made without its backend's words: the policy cache's
            self.kv_layout = policy_cache_layout(self.policy)

    @property
    def exact(self) -> bool:
        return self.policy.exact

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @classmethod
    def fixed(cls, backend: str, spec: ModelSpec, policy: KVPolicy, context: int | None = None,
              reason: str = "", kv_layout: str = "") -> "Plan":
        """A plan that takes the policy as given (``--kv`` or a test), with the cost model's projection;
        ``kv_layout`` defaults to the policy cache's (kvcache/eviction.py)."""
        ctx = context or spec.context_length
        return cls(backend=backend, policy=policy, context=ctx,
                   kv_bytes=cost.max_kv_bytes(spec, policy, ctx), weight_bytes=spec.weight_bytes,
                   reasons=[reason or f"KV policy {policy} as requested"],
                   kv_layout=kv_layout)

    def to_dict(self) -> dict:
        return {
            "backend": self.backend, "policy": str(self.policy), "exact": self.exact, "kv_layout": self.kv_layout,
            "context": self.context, "kv_bytes": self.kv_bytes, "weight_bytes": self.weight_bytes,
            "memory_bytes": self.memory_bytes, "decode_tok_s": self.decode_tok_s,
            "prefill_tok_s": self.prefill_tok_s, "hardware": self.hardware, "reasons": list(self.reasons),
            "rejected": [r.__dict__ for r in self.rejected], "quality": self.quality,
        }
