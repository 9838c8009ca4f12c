"""The schedule: every run walks the contexts, and at each context measures the baseline and every
series back to back (in an order that rotates), so machine drift hits all of them alike."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from localctx.app.bench.measure import MeasureRequest, Sample
from localctx.app.bench.settings import BenchSettings, Series, context_label
from localctx.app.bench.worker import Worker
from localctx.backends import registry
from localctx.backends.models.ref import ModelRef
from localctx.kvcache.errors import UserError
from localctx.kvcache.model_spec import ModelSpec


@dataclass
class Lineup:
    """The series that will run, and those refused up front with the backend's reason."""
    series: list[Series] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # series key → reason
    refused_series: list[Series] = field(default_factory=list)


def baseline_problem(ref: ModelRef) -> str | None:
    if ref.kind != "gguf":
        return f"the plain llama.cpp baseline needs a GGUF model and {ref.name} is not one"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed: pip install llama-cpp-python"
    return None


def refusals(series: Series, spec: ModelSpec) -> list[str]:
    """Why this build cannot run the series here (backend missing, or policy refused); empty if it can."""
    try:
        backend = registry.get(series.backend)
    except UserError as exc:
        return [str(exc)]
    return backend.refusals(series.kv_policy, spec)


def make_lineup(settings: BenchSettings, ref: ModelRef, spec: ModelSpec) -> Lineup:
    lineup = Lineup()
    problem = baseline_problem(ref)
    base = Series("llama-cpp-python", "fp16", baseline=True)
    if problem:
        lineup.refused[base.key], lineup.refused_series = problem, [base]
    else:
        lineup.series.append(base)
    for backend_name in settings.backends:
        for policy_text in settings.policies:
            series = Series(backend_name, policy_text)
            reasons = refusals(series, spec)
            if reasons:
                lineup.refused[series.key] = "; ".join(reasons)
                lineup.refused_series.append(series)
            else:
                lineup.series.append(series)
    if not any(not s.baseline for s in lineup.series):
        raise UserError("nothing to measure: " + "; ".join(f"{k}: {v}" for k, v in lineup.refused.items())
                        + ". Choose --backend/--kv that this machine runs")
    return lineup


def schedule(series: list[Series], contexts: list[int], runs: int, trained: int) -> list[tuple[int, int, Series]]:
    """(run, context, series) in measuring order: per run, per context, all series in a rotating order."""
    out = []
    step = 0
    for run in range(runs):
        for context in contexts:
            here = [s for s in series if s.applies_to(context, trained)]
            k = step % len(here) if here else 0
            out.extend((run, context, s) for s in here[k:] + here[:k])
            step += 1
    return out


Samples = dict[tuple[str, int], list[Sample]]


@dataclass
class Outcome:
    samples: Samples
    runs_done: int
    stopped: str | None = None  # why fewer runs than asked were made


def over_budget(started: float, now: float, runs_done: int, max_minutes: float | None) -> bool:
    """Would one more run (as long as the runs so far took on average) pass ``max_minutes``?"""
    if max_minutes is None or runs_done == 0:
        return False
    elapsed = now - started
    return elapsed + elapsed / runs_done > max_minutes * 60


def run_bench(settings: BenchSettings, lineup: Lineup, trained: int, console: Console) -> Outcome:
    plan = schedule(lineup.series, settings.contexts, settings.runs, trained)
    logs = Path(settings.out) / "logs"
    workers = {s.key: Worker(s.key, logs / f"{s.key.replace('/', '_')}.log") for s in lineup.series}
    samples: Samples = {}
    started, runs_done, stopped = time.perf_counter(), 0, None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("bench", total=len(plan))
            for run, context, series in plan:
                if run > runs_done:  # a run is complete: every series at every context
                    runs_done = run
                    if over_budget(started, time.perf_counter(), runs_done, settings.max_minutes):
                        stopped = (f"stopped after {runs_done} of {settings.runs} runs: another would pass "
                                   f"--max-minutes {settings.max_minutes:g}")
                        break
                progress.update(task, description=f"run {run + 1}/{settings.runs} · {context_label(context):>4} · "
                                                  f"{series.key}")
                req = MeasureRequest(backend=series.backend, policy=series.policy, model=settings.model,
                                     context=context, gen_tokens=settings.gen_tokens, threads=settings.threads,
                                     baseline=series.baseline)
                samples.setdefault((series.key, context), []).append(workers[series.key].measure(req))
                progress.advance(task)
            else:
                runs_done = settings.runs
    finally:
        for worker in workers.values():
            worker.close()
    if stopped:
        console.print(stopped)
    return Outcome(samples, runs_done, stopped)
