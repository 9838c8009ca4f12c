"""The live figures the side panel shows, taken from a GenerationEvent's stats and the session's plan.
No figure is computed here that the events or the plan do not already report."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.backends.base import GenerationStats, Session
from localctx.kvcache.plan import Plan


@dataclass(frozen=True)
class SessionFacts:
    """What does not change while a session lives."""
    backend: str
    model: str
    hardware: str
    plan: Plan

    @classmethod
    def planned(cls, plan: Plan, model: str, hardware: str) -> "SessionFacts":
        """Before the model is loaded: what the plan says."""
        return cls(backend=plan.backend, model=model, hardware=plan.hardware or hardware, plan=plan)

    @classmethod
    def of(cls, session: Session, hardware: str) -> "SessionFacts":
        return cls(backend=session.backend_name, model=session.spec.name,
                   hardware=session.plan.hardware or hardware, plan=session.plan)


@dataclass(frozen=True)
class CacheFigures:
    """One snapshot of the panel: the latest stats (None before the first answer) and the state."""
    facts: SessionFacts
    stats: GenerationStats | None = None
    state: str = "idle"  # starting | idle | prefilling | streaming | stopped | done | failed | loading

    @property
    def prefill_tok_s(self) -> float:
        return self.stats.prefill_tok_s if self.stats else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.stats.decode_tok_s if self.stats else 0.0

    @property
    def context_used(self) -> int:
        """Tokens of this conversation that went through the cache: the prompt plus the answer so far."""
        return self.stats.prompt_tokens + self.stats.generated_tokens if self.stats else 0

    @property
    def context_budget(self) -> int:
        return self.facts.plan.context

    @property
    def kv_bytes(self) -> int:
        return self.stats.kv_bytes if self.stats else 0

    @property
    def kv_budget(self) -> int:
        return self.facts.plan.kv_bytes

    @property
    def kv_allocated(self) -> int:
        """KV bytes allocated now: the session grows it toward ``kv_budget`` (kvcache/plan.py)."""
        return self.facts.plan.allocated_bytes

    @property
    def kv_tokens(self) -> int:
        return self.stats.kv_tokens if self.stats else 0

    @property
    def cached_tokens(self) -> int:
        return self.stats.cached_tokens if self.stats else 0

    @property
    def evicted_tokens(self) -> int:
        return self.stats.evicted_tokens if self.stats else 0

    @property
    def policy(self) -> str:
        return str(self.facts.plan.policy)

    @property
    def exact(self) -> bool:
        return self.facts.plan.exact
