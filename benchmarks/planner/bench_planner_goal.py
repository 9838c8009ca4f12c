"""The bench's planner goal, judged over a saved ``localctx bench`` result without measuring again.

A saved bench.json holds every series' measured decode speeds. This asks the planner what it would
pick where a choice is forced (``Projector.forced_picks``: under the largest memory cap that fp16's KV
does not fit under, and under a decode target just above its own fp16 projection) and judges those
picks against the saved measurements with ``goals.planner_goal`` and ``goals.planner_speed_goal``:
the goals `localctx bench` now evaluates in every run. The planner runs on a named hardware profile (``--hardware``, default
``cpu-24gb``, whose calibration key is the dev machine class the committed run measured), so the
picks are the ones the planner makes for that machine, not for whatever host runs this script. Each
backend's speed model is its calibration for that profile's key under this process's backend settings
(a named profile alone would look up the plain backend name): set LOCALCTX_TORCH_DTYPE / _WEIGHTS /
_THREADS as the run did, and an empty LOCALCTX_CACHE_DIR so only the committed calibrations count.

    LOCALCTX_CACHE_DIR=$(mktemp -d) LOCALCTX_TORCH_DTYPE=bf16 LOCALCTX_TORCH_WEIGHTS=int8 \\
        LOCALCTX_TORCH_THREADS=2 python benchmarks/planner/bench_planner_goal.py docs/results/bench/bench.json \\
        --json docs/results/bench/benchmarks-bench-planner-goal.json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from localctx.app.bench import goals
from localctx.app.bench.projection import Projector
from localctx.backends import registry
from localctx.kvcache import calibration
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.speed import SpeedModel


def use_run_calibrations(projector: Projector) -> dict[str, str]:
    """Give each backend the calibration its current settings name, for the profile's key; → sources."""
    sources = {}
    for name, ctx in projector.contexts.items():
        cls = registry.backend_class(name)
        cal = calibration.load(cls().calibration_name(), ctx.hardware.key) if cls else None
        projector.contexts[name] = replace(ctx, speed=SpeedModel(ctx.hardware, cal))
        sources[name] = cal.source if cal else "none: the roofline"
    return sources


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("saved", help="a bench.json written by localctx bench")
    ap.add_argument("--hardware", default="cpu-24gb", help="named hardware profile the planner plans for")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the picks and the verdict here")
    args = ap.parse_args(argv)

    result = json.loads(Path(args.saved).read_text())
    spec = ModelSpec.from_dict(result["model"]["spec"])
    settings = result["settings"]
    projector = Projector(spec, settings["backends"], hardware=args.hardware)
    calibrations = use_run_calibrations(projector)
    free_picks = projector.picks(settings["backends"], settings["contexts"])
    forced = projector.forced_picks(settings["backends"], settings["contexts"], settings["policies"])
    comparisons = result["quant_vs_fp16"]
    verdicts = [goals.planner_goal(free_picks, comparisons, forced, result["series"]),
                goals.planner_speed_goal(forced, result["series"])]
    out = {"saved_result": args.saved, "saved_command": result["command"], "saved_started": result["started"],
           "planner_hardware": projector.hardware.describe(), "calibrations": calibrations,
           "planner_picks": free_picks,
           "forced_picks": forced, "goals": verdicts,
           "command": "python benchmarks/planner/bench_planner_goal.py " + " ".join(argv or sys.argv[1:])}
    print("calibrations: " + ", ".join(f"{k}: {v}" for k, v in calibrations.items()))
    for pick in forced:
        extra = (f"cap {pick['max_memory'] / 2**30:.2f} GiB (KV room {pick['kv_budget'] / 2**20:.1f} MiB; fits: "
                 f"{', '.join(pick['fitting']) or 'none'})" if pick["forced"] == "memory"
                 else f"target {pick['min_tok_s']} tok/s")
        print(f"{pick['backend']:9} {pick['context']:>6} {pick['forced']:7} {extra} → {pick['policy']}")
    for verdict in verdicts:
        print(f"{verdict['status']}: {verdict['goal']}\n  {verdict['detail']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
