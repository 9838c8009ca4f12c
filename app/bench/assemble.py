"""The bench result as one JSON-ready dict: machine, model, settings, every series' points, the
headline ratios and the goals. Tables, plots and the docs page are all drawn from this dict, so a
saved run can be re-rendered without measuring again."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.app.bench import goals
from localctx.app.bench.baseline import baseline_settings
from localctx.app.bench.projection import Projector
from localctx.app.bench.results import PointInputs, headline, point
from localctx.app.bench.schedule import Lineup, Outcome
from localctx.app.bench.settings import BenchSettings, Series
from localctx.backends.models.ref import ModelRef
from localctx.kvcache.model_spec import ModelSpec

SCHEMA = "localctx.bench/2"


@dataclass
class RunInfo:
    command: str
    started: str
    finished: str
    duration_s: float
    machine: dict
    llama_cpp_version: str | None = None


def label(series: Series) -> str:
    if series.baseline:
        return "llama.cpp plain (defaults)"
    return f"localctx {series.backend} {series.policy}"


def _entry(series: Series, status: str, reason: str | None, points: list[dict]) -> dict:
    policy = series.kv_policy
    return {"key": series.key, "label": label(series), "backend": series.backend, "policy": series.policy,
            "baseline": series.baseline, "exact": policy.exact, "status": status, "reason": reason, "points": points}


def build_result(settings: BenchSettings, lineup: Lineup, outcome: Outcome, ref: ModelRef, spec: ModelSpec,
                 info: RunInfo, projector: Projector) -> dict:
    samples = outcome.samples
    inputs = PointInputs(projector=projector, trained=spec.context_length)
    planner_picks = projector.picks(settings.backends, settings.contexts)
    forced_picks = projector.forced_picks(settings.backends, settings.contexts, settings.policies)
    entries = [_entry(s, "ok", None, [point(s, c, samples, inputs) for c in settings.contexts])
               for s in lineup.series]
    entries += [_entry(s, "refused", lineup.refused[s.key], []) for s in lineup.refused_series]
    head = headline(entries, settings.contexts, spec.context_length)
    goal_rows, comparisons = goals.evaluate(entries, head, planner_picks, forced_picks)
    return {
        "schema": SCHEMA,
        "command": info.command,
        "started": info.started, "finished": info.finished, "duration_s": round(info.duration_s, 1),
        "machine": info.machine,
        "model": {"ref": settings.model or "default", "name": spec.name, "path": str(ref.path), "spec": spec.to_dict()},
        "settings": {"backends": settings.backends, "policies": settings.policies, "contexts": settings.contexts,
                     "runs": outcome.runs_done, "runs_asked": settings.runs, "stopped": outcome.stopped,
                     "max_minutes": settings.max_minutes, "gen_tokens": settings.gen_tokens,
                     "threads": settings.threads},
        "baseline": {"label": "llama.cpp plain (defaults)", "settings": baseline_settings(settings.threads),
                     "llama_cpp_version": info.llama_cpp_version,
                     "measured": not any(s.baseline for s in lineup.refused_series)},
        "projection": {"bandwidth": projector.bandwidth(),
                       "formula": "decode tok/s ≤ bandwidth / (weight bytes + KV bytes at the context)",
                       "planner": "the planner's speed model (localctx.kvcache.speed): calibrated per backend and KV "
                                  "format where a calibration exists, else the same roofline",
                       "planner_picks": planner_picks, "forced_picks": forced_picks},
        "series": entries,
        "headline": head,
        "quant_vs_fp16": comparisons,
        "goals": goal_rows,
        "plots": [],
    }
