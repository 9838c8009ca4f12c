"""Projected vs measured decode tok/s of the llama.cpp or torch backend on this machine.

The planner's projection (the backend's calibration for this CPU class, from the user cache or the
committed default in assets/; for torch, the one measured with the current LOCALCTX_TORCH_* settings)
is compared with `session.generate` on the bundled SmolLM2 at 256, 2K and 8K prompt tokens, greedy,
fp16 KV unless --kv names another policy. Rounds are interleaved (each round visits every context
length, ascending, reusing the cached prefix), and medians are reported.

    python benchmarks/planner/planner_speed.py --rounds 3 [--backend torch] [--kv POLICY] [--calibrate] [--save m.json]
    python benchmarks/planner/planner_speed.py --report m.json   # project again, e.g. after calibrating
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from localctx.app.session_options import SessionRequest, resolve_model
from localctx.app.bench.prompt import fit_text
from localctx.backends import registry
from localctx.backends.base import GenerationParams
from localctx.backends.machine.planner_inputs import calibrate_and_save, planning_context
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


def measure(args) -> dict:
    contexts = [int(c) for c in args.contexts.split(",")]
    req = SessionRequest(model=None, backend=args.backend, context=max(contexts) + args.gen + 64)
    ref, spec = resolve_model(req)
    plan = Plan.fixed(args.backend, spec, KVPolicy.parse(args.kv), req.context)
    session = registry.get(args.backend).load(ref, plan)
    prompts = {n: fit_text(session.count_tokens, n) for n in contexts}
    measured: dict[int, list[float]] = {n: [] for n in contexts}
    for r in range(args.rounds):
        session.reset()
        for n in contexts:  # ascending: each prompt extends the cached previous one
            done = list(session.generate(prompts[n], GenerationParams(max_tokens=args.gen)))[-1]
            measured[n].append(done.stats.decode_tok_s)
            print(f"  round {r + 1}: {done.stats.prompt_tokens} prompt tokens → {done.stats.decode_tok_s:.1f} tok/s",
                  file=sys.stderr)
    session.close()
    return {"backend": args.backend, "policy": str(plan.policy), "gen": args.gen,
            "measured": {str(k): v for k, v in measured.items()}}


def report(data: dict) -> int:
    """Projected (from the calibration found now) beside measured, as a markdown table."""
    backend = data.get("backend", "llamacpp")
    _, spec = resolve_model(SessionRequest(model=None, backend=backend))
    ctx = planning_context(backend, spec)
    policy = KVPolicy.parse(data["policy"])
    print(f"{backend} {policy} on {ctx.hardware.name}; projection basis: {ctx.speed.basis(policy)}")
    print("\n| prompt tokens | projected tok/s | measured tok/s (median) | measured / projected | runs |")
    print("|---:|---:|---:|---:|---|")
    worst = 0.0
    for key, runs in data["measured"].items():
        n = int(key)
        projected = ctx.speed.decode_tok_s(spec, policy, n + data["gen"] // 2)
        med = statistics.median(runs)
        worst = max(worst, abs(med / projected - 1))
        print(f"| {n:,} | {projected:.1f} | {med:.1f} | {med / projected:.2f} | " + ", ".join(f"{x:.1f}" for x in runs)
              + " |")
    print(f"\nlargest deviation: {worst:.0%} ({'within' if worst <= 0.25 else 'OUTSIDE'} ±25%)")
    return 0 if worst <= 0.25 else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="llamacpp", choices=("llamacpp", "torch"))
    ap.add_argument("--contexts", default="256,2048,8000")
    ap.add_argument("--gen", type=int, default=48, help="tokens generated per measurement")
    ap.add_argument("--kv", default="fp16", help="KV policy (default fp16: the format the planner picks here)")
    ap.add_argument("--calibrate", action="store_true", help="re-measure the calibration first")
    ap.add_argument("--save", default=None, help="write the measurements to this JSON file")
    ap.add_argument("--report", default=None, help="only report measurements saved earlier with --save")
    args = ap.parse_args()
    if args.report:
        return report(json.loads(Path(args.report).read_text()))
    if args.calibrate:
        _, path = calibrate_and_save(args.backend, progress=lambda s: print(s, file=sys.stderr))
        print(f"calibration written to {path}", file=sys.stderr)
    data = measure(args)
    if args.save:
        Path(args.save).write_text(json.dumps(data, indent=1))
    return report(data)


if __name__ == "__main__":
    sys.exit(main())
