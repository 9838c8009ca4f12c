"""A 16K-token stream through the llama.cpp backend under the auto plan (SmolLM2, trained on 8K).

For each plan (no target, and --min-tok-s 100) the session streams the first k tokens of a long
text (k = checkpoints up to 16K, each a fresh stream that passes through the context shift) and
then decodes; the decode tok/s after k tokens is recorded. Plain llama.cpp (llama-cpp-python
defaults but the same threads, n_ctx = the trained 8K, fp16 KV) is measured in the same rounds at
the checkpoints it can hold. Rounds interleave the plans so that load from other processes hits
them alike; medians are reported.

    python benchmarks/planner/planner_stream.py --rounds 2
    python benchmarks/planner/planner_stream.py --decode-stream 16384   # one long generation
    python benchmarks/planner/planner_stream.py --decode-stream 16384 --target-only
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from localctx.app.session_options import SessionRequest, make_plan, resolve_model
from localctx.backends.base import GenerationParams
from localctx.backends.llamacpp.backend import LlamaCppBackend
from localctx.backends.llamacpp.session import default_threads
from localctx.kvcache.planner import NoPlanFits


def text_ids(llm, n: int) -> list[int]:
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics.values())
    ids = llm.tokenize(text.encode(), add_bos=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def prompt_of(llm, n: int) -> str:
    return llm.detokenize(text_ids(llm, n - 1)).decode("utf-8", errors="ignore")


def plain_decode_tok_s(llm, ids: list[int], gen: int) -> float:
    llm.reset()
    llm._ctx.kv_cache_clear()
    stamps = []
    for tok in llm.generate(ids, top_k=0, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        if len(stamps) == gen:
            break
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def checkpoints_run(args, sessions: dict, plain) -> None:
    checkpoints = [int(c) for c in args.checkpoints.split(",")]
    any_llm = next(iter(sessions.values())).llm
    prompts = {k: prompt_of(any_llm, k) for k in checkpoints}
    results: dict[str, dict[int, list[float]]] = {name: {k: [] for k in checkpoints} for name in sessions}
    results["plain llama.cpp (n_ctx 8192)"] = {k: [] for k in checkpoints}
    for r in range(args.rounds):
        for k in checkpoints:
            for name, session in sessions.items():
                session.reset()
                done = list(session.generate(prompts[k], GenerationParams(max_tokens=args.gen)))[-1]
                results[name][k].append(done.stats.decode_tok_s)
                print(f"  round {r + 1} {name} after {done.stats.prompt_tokens:,} tokens: "
                      f"{done.stats.decode_tok_s:.1f} tok/s, cache {done.stats.kv_tokens:,} tokens, "
                      f"evicted {done.stats.evicted_tokens:,}", file=sys.stderr)
            if k + args.gen <= 8192:
                results["plain llama.cpp (n_ctx 8192)"][k].append(
                    plain_decode_tok_s(plain, text_ids(plain, k), args.gen))
    print("\n| decode tok/s after k tokens (median) | " + " | ".join(f"{k:,}" for k in checkpoints) + " |")
    print("|---|" + "---:|" * len(checkpoints))
    for name, row in results.items():
        cells = [f"{statistics.median(v):.1f}" if v else "cannot (past n_ctx)" for v in row.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name in sessions:
        row = results[name]
        last = max(row)
        if 4096 in row and last > 4096:
            ratio = statistics.median(row[last]) / statistics.median(row[4096])
            print(f"\n{name}: after {last:,} / after 4,096 = {ratio:.2f} "
                  f"({'within' if abs(ratio - 1) <= 0.10 else 'OUTSIDE'} 10%)")
        print(f"{name}: slowest checkpoint median {min(statistics.median(v) for v in row.values()):.1f} tok/s")


def decode_stream_run(args, sessions: dict) -> None:
    """One long generation per plan: tok/s per 1,024-token stretch of the stream."""
    for name, session in sessions.items():
        session.reset()
        stamps = []
        for event in session.generate("Once upon a time", GenerationParams(max_tokens=args.decode_stream)):
            if event.kind == "token":
                stamps.append(time.perf_counter())
        rates = [1023 / (stamps[i + 1023] - stamps[i]) for i in range(1, len(stamps) - 1023, 1024)]
        print(f"{name}: {len(stamps):,} tokens; tok/s per 1K stretch: " + ", ".join(f"{r:.0f}" for r in rates)
              + f"; min {min(rates):.0f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--checkpoints", default="1024,2048,4096,8192,16384")
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--min-tok-s", type=float, default=100.0)
    ap.add_argument("--decode-stream", type=int, default=0, help="generate this many tokens instead")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--no-target", action="store_true", help="only the plan without a speed target")
    which.add_argument("--target-only", action="store_true", help="only the plan with the speed target")
    args = ap.parse_args()
    sessions = {}
    targets = ([] if args.target_only else [("auto plan", None)]) + \
        ([] if args.no_target else [(f"auto plan, --min-tok-s {args.min_tok_s:g}", args.min_tok_s)])
    for label, target in targets:
        req = SessionRequest(model=None, backend="llamacpp", context=16384, min_tok_s=target)
        ref, spec = resolve_model(req)
        try:
            plan = make_plan(req, spec)
        except NoPlanFits as exc:  # e.g. a machine too busy or too slow for the target
            print(f"{label}: no plan — {exc.headline}")
            continue
        print(f"{label}: {plan.policy} — " + " | ".join(plan.reasons[2:]))
        sessions[f"{label} ({plan.policy})"] = LlamaCppBackend().load(ref, plan)
    if args.decode_stream:
        decode_stream_run(args, sessions)
        return 0
    from llama_cpp import Llama

    plain = Llama(model_path=str(ref.path), n_ctx=8192, n_threads=default_threads(), verbose=False)
    checkpoints_run(args, sessions, plain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
