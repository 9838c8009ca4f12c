"""From samples to figures: medians and spread per point, ratios against the baseline measured in the
same run, the headline ratio decode(long)/decode(short), and which goals hold."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from localctx.app.bench.measure import Sample
from localctx.app.bench.projection import BASELINE_AS, Projector
from localctx.app.bench.schedule import Samples
from localctx.app.bench.settings import BASELINE_KEY, Series

WINDOW_GOAL = 0.85


def summary(values: list[float]) -> dict:
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    return {"median": med, "min": lo, "max": hi,
            "spread_pct": round(100 * (hi - lo) / 2 / med, 1) if med else 0.0, "values": values}


def paired_ratio(mine: list[Sample], base: list[Sample], field: str) -> float | None:
    """Median of run-by-run ratios when both sides have every run (drift cancels), else ratio of medians."""
    if not mine or not base:
        return None
    a = [getattr(s, field) for s in mine]
    b = [getattr(s, field) for s in base]
    if len(a) == len(b) and all(b):
        return statistics.median(x / y for x, y in zip(a, b))
    med_b = statistics.median(b)
    return statistics.median(a) / med_b if med_b else None


@dataclass(frozen=True)
class PointInputs:
    projector: Projector
    trained: int


def point(series: Series, context: int, samples: Samples, inputs: PointInputs) -> dict:
    if not series.applies_to(context, inputs.trained):
        return {"context": context, "status": "n/a",
                "reason": f"past the trained context ({inputs.trained:,}); only windowed policies stream past it"}
    got = samples.get((series.key, context), [])
    ok = [s for s in got if s.error is None]
    errors = [s.error for s in got if s.error is not None]
    if not ok:
        return {"context": context, "status": "error", "reason": errors[0] if errors else "not measured"}
    stream_tokens = ok[0].kv_tokens + ok[0].evicted_tokens
    proj = inputs.projector.project(BASELINE_AS if series.baseline else series.backend, series.kv_policy, context,
                                    stream_tokens)
    decode = summary([s.decode_tok_s for s in ok])
    base_ok = [s for s in samples.get((BASELINE_KEY, context), []) if s.error is None]
    out = {
        "context": context, "status": "ok", "runs": len(ok), "errors": errors,
        "prompt_tokens": ok[0].prompt_tokens, "generated_tokens": min(s.generated_tokens for s in ok),
        "prefill_tok_s": summary([s.prefill_tok_s for s in ok]), "decode_tok_s": decode,
        "kv_bytes": ok[0].kv_bytes, "kv_tokens": ok[0].kv_tokens, "evicted_tokens": ok[0].evicted_tokens,
        "kv_bytes_projected": proj.kv_bytes, "peak_rss_bytes": max(s.peak_rss_bytes for s in ok),
        "peak_scope": ok[0].peak_scope,
        "device_peak_bytes": max((s.device_peak_bytes or 0) for s in ok) or None,
        "load_s": summary([s.load_s for s in ok])["median"],
        "roofline_decode_tok_s": proj.roofline_decode_tok_s,
        "roofline_fraction": decode["median"] / proj.roofline_decode_tok_s if proj.roofline_decode_tok_s else None,
        "planner_decode_tok_s": proj.planner_decode_tok_s, "planner_basis": proj.planner_basis,
        "decode_vs_baseline": None if series.baseline else paired_ratio(ok, base_ok, "decode_tok_s"),
        "prefill_vs_baseline": None if series.baseline else paired_ratio(ok, base_ok, "prefill_tok_s"),
        "samples": [s.to_dict() for s in got],
    }
    return out


def decode_at(entry: dict, context: int) -> float | None:
    for p in entry["points"]:
        if p["context"] == context and p["status"] == "ok":
            return p["decode_tok_s"]["median"]
    return None


def headline_contexts(contexts: list[int], trained: int) -> tuple[int, int] | None:
    inside = [c for c in contexts if c <= trained]
    return (inside[0], inside[-1]) if len(inside) >= 2 else None


def headline(entries: list[dict], contexts: list[int], trained: int) -> dict | None:
    """decode tok/s at the longest context within the trained length ÷ at the shortest, per series; for
    windowed series also at the longest context measured (past the trained length)."""
    span = headline_contexts(contexts, trained)
    if span is None:
        return None
    lo, hi = span
    rows = []
    for e in (e for e in entries if e["status"] == "ok"):
        short, long_ = decode_at(e, lo), decode_at(e, hi)
        row = {"series": e["key"], "ratio": long_ / short if short and long_ else None}
        if contexts[-1] > hi:
            far = decode_at(e, contexts[-1])
            row["ratio_far"] = far / short if short and far else None
        rows.append(row)
    base = next((r["ratio"] for r in rows if r["series"] == BASELINE_KEY), None)
    for row in rows:
        row["vs_baseline_ratio"] = row["ratio"] / base if base and row["ratio"] is not None else None
    return {"short": lo, "long": hi, "far": contexts[-1] if contexts[-1] > hi else None, "rows": rows}
