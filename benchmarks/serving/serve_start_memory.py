"""Resident memory of a server at start: KV allocated for the whole planned context (what ``localctx serve``
did before its KV grew) against the first allocation it makes now (``--parallel`` × 1,024 tokens, growing
toward the context: app/session_options.SLOT_GROW_FROM_TOKENS, kvcache/growth.py).

Each variant loads in a fresh process the way ``localctx serve`` does (plan_session, then open_streams:
the session and its batched slots) and reports its resident set after loading; the variants alternate,
``--runs`` times each. Nothing is served: this is the memory at start, before any request.

    python benchmarks/serving/serve_start_memory.py --parallel 4 --json docs/results/serve/serve-start-memory.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys


def measure(model: str | None, backend: str, kv: str, context: int | None, parallel: int, grow: bool) -> dict:
    """In this process: load as serve does, return the resident set and the plan's allocation."""
    import psutil

    from localctx.app.serve.streams import open_streams
    from localctx.app.session_options import SLOT_GROW_FROM_TOKENS, SessionRequest, plan_session

    req = SessionRequest(model=model, backend=backend, kv=kv, context=context)
    if grow:
        req = dataclasses.replace(req, allocate=parallel * SLOT_GROW_FROM_TOKENS, grow_to_context=True)
    session, streams = open_streams(plan_session(req), parallel)
    plan = session.plan
    rss = psutil.Process().memory_info().rss
    out = {"grow": grow, "rss_bytes": rss, "context": plan.context, "allocated_context": plan.allocated_context,
           "kv_bytes": plan.kv_bytes, "allocated_kv_bytes": plan.allocated_bytes}
    streams.close()
    session.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="a GGUF (default: the bundled model)")
    p.add_argument("--backend", default="llamacpp")
    p.add_argument("--kv", default="fp16")
    p.add_argument("--context", type=int, default=None, help="the planned context (default: the trained one)")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--child", choices=("full", "grow"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.backend, args.kv, args.context, args.parallel,
                                 args.child == "grow")))
        return
    base = [sys.executable, __file__, "--backend", args.backend, "--kv", args.kv, "--parallel", str(args.parallel)]
    base += ["-m", args.model] if args.model else []
    base += ["--context", str(args.context)] if args.context else []
    samples: dict[str, list[dict]] = {"full": [], "grow": []}
    for _ in range(args.runs):
        for way in ("full", "grow"):
            done = subprocess.run(base + ["--child", way], capture_output=True, text=True, check=True)
            samples[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = {way: statistics.median(s["rss_bytes"] for s in runs) for way, runs in samples.items()}
    result = {"model": args.model or "bundled SmolLM2-135M-Instruct Q4_1", "backend": args.backend, "kv": args.kv,
              "parallel": args.parallel, "runs": args.runs, "load": os.getloadavg(),
              "median_rss_bytes": med, "rss_ratio_grow_to_full": med["grow"] / med["full"],
              "rss_saved_bytes": med["full"] - med["grow"], "samples": samples}
    mib = 1024 * 1024
    print(f"resident at start, median of {args.runs}: full context {med['full'] / mib:,.0f} MiB "
          f"(KV {samples['full'][0]['kv_bytes'] / mib:,.0f} MiB for {samples['full'][0]['context']:,} tokens), "
          f"growing {med['grow'] / mib:,.0f} MiB (KV {samples['grow'][0]['allocated_kv_bytes'] / mib:,.0f} MiB for "
          f"{samples['grow'][0]['allocated_context']:,} tokens): {result['rss_ratio_grow_to_full']:.2f}x")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
