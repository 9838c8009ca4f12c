"""What a bench run measures: contexts, runs, and the series (backend × policy, plus the baseline)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from localctx.kvcache.errors import UserError
from localctx.kvcache.policy import KVPolicy

DEFAULT_CONTEXTS = "256,1k,2k,4k,8k"
DEFAULT_POLICIES = ("fp16", "int8", "int4")
BASELINE_KEY = "llama-cpp-python"
_SIZE = re.compile(r"^(\d+)(k?)$")


def parse_contexts(text: str) -> list[int]:
    """'256,1k,8k' → [256, 1024, 8192] (sorted, unique). 1k = 1024 tokens."""
    out = set()
    for part in (p.strip().lower() for p in text.split(",")):
        m = _SIZE.match(part)
        if not m:
            raise UserError(f"--contexts {text!r}: {part!r} is not a token count; use e.g. 256,1k,2k,4k,8k")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 64:
            raise UserError(f"--contexts {text!r}: {n} tokens is too short to time; give at least 64")
        out.add(n)
    if not out:
        raise UserError("--contexts is empty; give e.g. 256,1k,2k,4k,8k")
    return sorted(out)


def context_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Series:
    """One line on the plots: a localctx backend with a KV policy, or the plain llama.cpp baseline."""
    backend: str
    policy: str  # canonical KVPolicy text
    baseline: bool = False

    @property
    def key(self) -> str:
        return BASELINE_KEY if self.baseline else f"{self.backend}/{self.policy}"

    @property
    def kv_policy(self) -> KVPolicy:
        return KVPolicy.parse(self.policy)

    def applies_to(self, context: int, trained: int) -> bool:
        """Contexts past the trained length are only for windowed policies (the stream goes past n_ctx)."""
        return context <= trained or (not self.baseline and self.kv_policy.evicts)


@dataclass
class BenchSettings:
    model: str | None
    backends: list[str]
    policies: list[str]
    contexts: list[int]
    runs: int = 3
    gen_tokens: int = 32
    out: str = "bench-out"
    threads: int = 1
    max_minutes: float | None = None
    series: list[Series] = field(default_factory=list)

    def check(self) -> None:
        if self.runs < 1:
            raise UserError(f"--runs {self.runs} must be at least 1")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise UserError(f"--max-minutes {self.max_minutes:g} must be positive")
        if not 4 <= self.gen_tokens <= 1024:
            raise UserError(f"--gen-tokens {self.gen_tokens} must be between 4 and 1024")
        too_short = [c for c in self.contexts if c <= self.gen_tokens + 16]
        if too_short:
            raise UserError(f"context {too_short[0]} leaves no room for a prompt beside {self.gen_tokens} "
                            "generated tokens; raise the context or lower --gen-tokens")


def policies_from(texts: list[str]) -> list[str]:
    """Canonical policy texts, in the order given, without duplicates (bad text → UserError)."""
    seen: list[str] = []
    for text in texts:
        canonical = str(KVPolicy.parse(text))
        if canonical not in seen:
            seen.append(canonical)
    return seen
