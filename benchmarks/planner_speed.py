"""Projected vs measured decode tok/s of the llama.cpp backend on this machine.

The planner's projection (the calibration for this CPU class, from the user cache or the committed
default in assets/) is compared with `session.generate` on the bundled SmolLM2 at 256, 2K and 8K
prompt tokens, greedy, through the localctx llama.cpp backend. Rounds are interleaved (each round
visits every context length, ascending, reusing the cached prefix), and medians are reported.

    PYTHONPATH=.dev python benchmarks/planner_speed.py --rounds 3 [--calibrate]
"""
from __future__ import annotations

import argparse
import statistics
import sys

from localctx.app.session_options import SessionRequest, make_plan, resolve_model
from localctx.backends.base import GenerationParams
from localctx.backends.llamacpp import LlamaCppBackend
from localctx.backends.planning import planning_context


def text_prompt(session, n_tokens: int) -> str:
    import pydoc_data.topics as topics

    ids = session.llm.tokenize("\n\n".join(topics.topics.values()).encode(), add_bos=False)[: n_tokens - 1]
    return session.llm.detokenize(ids).decode("utf-8", errors="ignore")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contexts", default="256,2048,8000")
    ap.add_argument("--gen", type=int, default=48, help="tokens generated per measurement")
    ap.add_argument("--calibrate", action="store_true", help="re-measure the calibration first")
    args = ap.parse_args()
    if args.calibrate:
        from localctx.backends.llamacpp_calibrate import calibrate_and_save

        cal, path = calibrate_and_save(progress=lambda s: print(s, file=sys.stderr))
        print(f"calibration written to {path}", file=sys.stderr)
    contexts = [int(c) for c in args.contexts.split(",")]
    req = SessionRequest(model=None, backend="llamacpp", context=max(contexts) + args.gen + 64)
    ref, spec = resolve_model(req)
    ctx = planning_context("llamacpp", spec)
    plan = make_plan(req, spec, ctx)
    speed = ctx.speed
    print(f"plan: {plan.policy} on {ctx.hardware.name}; projection basis: {speed.basis(plan.policy)}")
    session = LlamaCppBackend().load(ref, plan)
    prompts = {n: text_prompt(session, n) for n in contexts}
    measured: dict[int, list[float]] = {n: [] for n in contexts}
    for r in range(args.rounds):
        session.reset()
        for n in contexts:  # ascending: each prompt extends the cached previous one
            done = list(session.generate(prompts[n], GenerationParams(max_tokens=args.gen)))[-1]
            measured[n].append(done.stats.decode_tok_s)
            print(f"  round {r + 1}: {done.stats.prompt_tokens} prompt tokens → {done.stats.decode_tok_s:.1f} tok/s",
                  file=sys.stderr)
    session.close()
    print("\n| prompt tokens | projected tok/s | measured tok/s (median) | measured / projected | runs |")
    print("|---:|---:|---:|---:|---|")
    worst = 0.0
    for n in contexts:
        projected = speed.decode_tok_s(spec, plan.policy, n + args.gen // 2)
        med = statistics.median(measured[n])
        worst = max(worst, abs(med / projected - 1))
        print(f"| {n:,} | {projected:.1f} | {med:.1f} | {med / projected:.2f} | "
              + ", ".join(f"{x:.1f}" for x in measured[n]) + " |")
    print(f"\nlargest deviation: {worst:.0%} ({'within' if worst <= 0.25 else 'OUTSIDE'} ±25%)")
    return 0 if worst <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
