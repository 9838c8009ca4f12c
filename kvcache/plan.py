"""Plan: what the planner chose, what it projects, and why (docs/architecture.md "Core types")."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

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
    # tokens the session allocates when it loads (None: all of ``context``); it grows toward ``context``
    allocated: int | None = None
    allocated_kv_bytes: int | None = None  # KV bytes of ``allocated`` tokens, as the backend holds them
    quality: dict | None = None  # the chosen format's KL divergence figure, measured or prior (kvcache/kld_quality.py)
    window_quality: dict | None = None  # a windowed policy's measured window figure (quoted, not judged)

    def __post_init__(self) -> None:
        if not self.kv_layout:  # a plan made without its backend's words: the policy cache's
            self.kv_layout = policy_cache_layout(self.policy)

    @property
    def exact(self) -> bool:
        return self.policy.exact

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def allocated_context(self) -> int:
        """Tokens allocated at load: ``allocated``, or the whole ``context``."""
        return self.context if self.allocated is None else self.allocated

    @property
    def allocated_bytes(self) -> int:
        return self.kv_bytes if self.allocated_kv_bytes is None else self.allocated_kv_bytes

    def sized_to(self, tokens: int, cell: int, kv_bytes: Callable[[int], int]) -> "Plan":
        """This plan allocating ``tokens`` now, rounded up to the backend's ``cell`` and at most ``context``
        (``kv_bytes(n)``: the backend's bytes for n tokens); the maximum stays ``context`` / ``kv_bytes``. A
        windowed policy keeps its fixed capacity, so it is returned as is."""
        if self.policy.evicts:
            return self
        n = min(self.context, -(-max(1, tokens) // cell) * cell)
        return replace(self, allocated=n, allocated_kv_bytes=kv_bytes(n) if n < self.context else self.kv_bytes)

    def grow_to(self, tokens: int, kv_bytes: int) -> None:
        """Records that the session grew to hold ``tokens`` (``kv_bytes`` of KV allocated); in place, so
        what shows this plan (the chat's panel) shows the allocation as it is."""
        self.allocated, self.allocated_kv_bytes = tokens, kv_bytes

    def allocation_words(self) -> str:
        """"KV 12.0 MiB allocated for 768 tokens, grows to 180 MiB at 8,192", or the full allocation's words."""
        if self.allocated_context >= self.context:
            return f"KV {cost.format_bytes(self.kv_bytes)} allocated for all {self.context:,} tokens"
        if not self.allocated_bytes:  # a cache that allocates as it fills (MLX), before its first token
            return f"KV nothing allocated yet, grows to {cost.format_bytes(self.kv_bytes)} at {self.context:,}"
        return (f"KV {cost.format_bytes(self.allocated_bytes)} allocated for {self.allocated_context:,} tokens, "
                f"grows to {cost.format_bytes(self.kv_bytes)} at {self.context:,}")

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
            "memory_bytes": self.memory_bytes, "allocated_context": self.allocated_context,
            "allocated_kv_bytes": self.allocated_bytes, "decode_tok_s": self.decode_tok_s,
            "prefill_tok_s": self.prefill_tok_s, "hardware": self.hardware, "reasons": list(self.reasons),
            "rejected": [r.__dict__ for r in self.rejected], "quality": self.quality,
            "window_quality": self.window_quality,
        }
