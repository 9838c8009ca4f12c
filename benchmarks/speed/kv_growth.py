"""Growing a llama.cpp context (backends/llamacpp/grow.py): moving sequence 0's cells into a larger
context against re-prefilling the same tokens into it, for a conversation of N tokens, on the same
loaded weights, interleaved run by run. Writes JSON with every time and the medians.

    python benchmarks/speed/kv_growth.py --tokens 1000 --runs 5 --out docs/results/speed/kv_growth.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path


def prefilled(llm, tokens: list[int], n_ctx: int) -> None:
    """A fresh context of ``n_ctx`` cells holding ``tokens`` (the starting point of both ways)."""
    from llama_cpp import _internals

    llm.context_params.n_ctx = n_ctx
    llm._ctx.close()
    llm._ctx = _internals.LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
    llm._stack.enter_context(contextlib.closing(llm._ctx))
    llm.n_tokens = 0
    llm.eval(tokens)


def reprefill(llm, tokens: list[int], n_ctx: int) -> None:
    """The other way: a larger context with the tokens evaluated again."""
    from localctx.backends.llamacpp.grow import grow_context

    llm.n_tokens = 0  # nothing carried over
    grow_context(llm, n_ctx)
    llm.eval(tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens in the conversation when it grows")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("docs/results/speed/kv_growth.json"))
    args = ap.parse_args(argv)
    from llama_cpp import Llama

    from localctx.backends.llamacpp.grow import CELL, grow_context
    from localctx.backends.llamacpp.session import default_threads, quiet_stderr
    from localctx.backends.models.ref import bundled_default_path

    model = args.model or bundled_default_path()
    small = -(-(args.tokens + 1) // CELL) * CELL
    threads = default_threads()
    with quiet_stderr():
        llm = Llama(model_path=str(model), n_ctx=small, n_threads=threads, n_threads_batch=threads, verbose=False)
    text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(args.tokens))
    tokens = llm.tokenize(text.encode(), add_bos=True)[:args.tokens]
    load = os.getloadavg()[0]
    rows = []
    for i in range(args.runs):
        got = {}
        for way in (("move", "prefill") if i % 2 == 0 else ("prefill", "move")):
            prefilled(llm, tokens, small)
            t0 = time.perf_counter()
            grow_context(llm, 2 * small) if way == "move" else reprefill(llm, tokens, 2 * small)
            got[way] = time.perf_counter() - t0
            assert llm.n_tokens == len(tokens)
        rows.append({"move_s": round(got["move"], 5), "prefill_s": round(got["prefill"], 5)})
    llm.close()
    report = {"command": "python benchmarks/speed/kv_growth.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": model.name, "tokens": len(tokens), "from_cells": small, "to_cells": 2 * small,
              "threads": threads, "loadavg_before": round(load, 2), "loadavg_after": round(os.getloadavg()[0], 2),
              "runs": rows, "median_move_s": round(statistics.median(r["move_s"] for r in rows), 5),
              "median_prefill_s": round(statistics.median(r["prefill_s"] for r in rows), 5)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{model.name}, {len(tokens)} tokens, {small} → {2 * small} cells: move {report['median_move_s'] * 1e3:.1f} ms, "
          f"re-prefill {report['median_prefill_s'] * 1e3:.1f} ms (medians of {args.runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
