"""benchmarks/reuse/verify_cost.py on the bundled model with llama.cpp (two rounds): every verify length
from the plain step to the longest draft is timed against the plain step, and the ceiling is the
best tokens-per-cost over the lengths it reports."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_bench():
    sys.path.insert(0, str(BENCHMARKS / "tools"))  # its bench_json
    try:
        spec = importlib.util.spec_from_file_location("verify_cost", BENCHMARKS / "reuse" / "verify_cost.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS / "tools"))


def test_costs_are_against_the_plain_step_and_the_ceiling_is_the_best_of_them():
    bench = load_bench()
    row = bench.measure("llamacpp", rounds=2)
    cost = {int(t): c for t, c in row["step_cost_in_plain_steps"].items()}
    assert sorted(cost) == list(range(1, bench.MAX_DRAFT + 2)) and cost[1] == 1.0
    best = max(cost, key=lambda t: t / cost[t])
    assert row["ceiling_at_step_tokens"] == best and abs(row["ceiling"] - best / cost[best]) < 2e-3
    assert row["context_tokens"] > 300 and row["policy"] == "fp16"
