"""Measured quality of quantized KV formats per backend (assets/kv_quality.json), and the goals a
format must meet for the planner to choose it.

A verdict is one backend's measurement of one format (precision, group and residual: ``int8``,
``int4+res128``, ``k8v4``) against that backend's full-precision cache: the perplexity change in
percent and the passkey change in percentage points, with the command that measured it. The goals
(docs/quality.md): perplexity at most +0.5% where every quantized side is 8-bit, at most +3%
where a side is 4-bit, and no passkey loss. A format without a verdict on a backend is not
refused for quality; the planner says it is unmeasured there."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from localctx.kvcache.errors import UserError
from localctx.kvcache.policy import KVPolicy

PERPLEXITY_GOAL_PCT = {8: 0.5, 4: 3.0}  # by the fewest bits of either side
PASSKEY_GOAL_POINTS = 0.0  # no passkey loss


def format_key(policy: KVPolicy) -> str:
    """What a verdict is stored under: the policy's precision, group and residual (no window)."""
    return str(replace(policy, sinks=0, window=None, heavy=0))


def perplexity_goal(policy: KVPolicy) -> float:
    return PERPLEXITY_GOAL_PCT[min(policy.k_bits, policy.v_bits)]


@dataclass(frozen=True)
class Verdict:
    backend: str
    format: str
    perplexity_delta_pct: float
    passkey_delta_points: float | None  # None: passkey not measured (only the perplexity goal is judged)
    source: str
    detail: str = ""
    model: str = ""  # the model it was measured on

    def measured(self) -> str:
        on = f"{self.backend}" + (f" with {self.model}" if self.model else "")
        passkey = ("passkey not measured" if self.passkey_delta_points is None
                   else f"passkey {self.passkey_delta_points:+g} points")
        return f"measured on {on}: perplexity {self.perplexity_delta_pct:+.2f}%, {passkey} vs full precision ({self.source})"

    def broken_goals(self, policy: KVPolicy) -> str | None:
        """Why this measurement breaks the goals for ``policy``'s precision, or None."""
        goal = perplexity_goal(policy)
        broken = []
        if self.perplexity_delta_pct > goal:
            broken.append(f"perplexity over +{goal:g}%")
        if self.passkey_delta_points is not None and self.passkey_delta_points < -PASSKEY_GOAL_POINTS:
            broken.append("passkey loss")
        if not broken:
            return None
        return f"{self.measured()}: {' and '.join(broken)} breaks the quality goals (docs/quality.md)"


@dataclass(frozen=True)
class QualityTable:
    verdicts: dict  # backend → format → Verdict

    def verdict(self, backend: str, policy: KVPolicy) -> Verdict | None:
        if not policy.quantized:
            return None
        return self.verdicts.get(backend, {}).get(format_key(policy))

    def for_backend(self, backend: str) -> "BackendQuality":
        return BackendQuality(backend, self)


@dataclass(frozen=True)
class BackendQuality:
    """One backend's verdicts, as the planner asks them."""
    backend: str
    table: QualityTable

    def verdict(self, policy: KVPolicy) -> Verdict | None:
        return self.table.verdict(self.backend, policy)

    def refusal(self, policy: KVPolicy) -> str | None:
        v = self.verdict(policy)
        return v.broken_goals(policy) if v is not None else None

    def note(self, policy: KVPolicy) -> str:
        """The measured quality of a quantized format here, or that it is unmeasured."""
        v = self.verdict(policy)
        if v is not None:
            return v.measured()
        return (f"quality of {format_key(policy)} not measured on {self.backend} "
                "(assets/kv_quality.json; docs/quality.md has what is)")


NO_VERDICTS = QualityTable({})


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def parse(data: dict, source: str) -> QualityTable:
    try:
        verdicts = {backend: {fmt: Verdict(backend, str(KVPolicy.parse(fmt)), float(v["perplexity_delta_pct"]),
                                           _optional_float(v["passkey_delta_points"]), str(v["source"]),
                                           str(v.get("detail", "")),
                                           str(v.get("model", "")))
                              for fmt, v in formats.items()}
                    for backend, formats in data["verdicts"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{source} is not a KV quality table ({type(exc).__name__}: {exc}); restore it from the "
                        "repository") from None
    for backend, formats in verdicts.items():
        for fmt, v in formats.items():
            if fmt != format_key(KVPolicy.parse(fmt)) or not KVPolicy.parse(fmt).quantized:
                raise UserError(f"{source}: {backend} verdict {fmt!r} must name a quantized format without a "
                                "window (e.g. int8, int4+res128, k8v4)")
    return QualityTable(verdicts)


def load(path: Path | None = None) -> QualityTable:
    """The table in ``path``, or the one shipped in assets/kv_quality.json."""
    if path is not None:
        return parse(json.loads(Path(path).read_text()), str(path))
    text = resources.files("localctx.assets").joinpath("kv_quality.json").read_text()
    return parse(json.loads(text), "assets/kv_quality.json")
