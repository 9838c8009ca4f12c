"""Decode speed of the torch backend beside llama.cpp, measured in the same run.

    python benchmarks/speed/torch_decode.py --dtype fp32 --weights int8 --threads 1

For each context length the prompt (English text from pydoc_data.topics) is prefilled once;
batch B > 1 forks that sequence's blocks into B-1 more sequences (same KV content, separate
blocks, so attention reads B× the KV), then times decode steps. Rounds of torch batch-1 steps
and llama.cpp steps are interleaved so both see the same machine load. Prints a markdown table
and, with --json, writes the raw figures."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from localctx.backends.models.ref import resolve
from localctx.backends.torch.loading import DTYPES, TorchOptions, build_session, load_model
from localctx.kvcache.paged import DEFAULT_BLOCK_SIZE
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


def long_text_ids(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"pydoc_data.topics gives only {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def fork(cache, src: int, dst: int, reserve: int) -> None:
    """A new sequence holding a copy of ``src``'s K/V in its own blocks."""
    cache.add_sequence(dst, reserve_tokens=reserve)
    cache.begin_step([dst], cache.length(src))
    cache.end_step()
    s = torch.tensor(cache.pool.block_table(src))
    d = torch.tensor(cache.pool.block_table(dst))
    cache.k[:, d] = cache.k[:, s]
    cache.v[:, d] = cache.v[:, s]


def torch_steps(engine, seqs: list[int], first: list[int], n: int) -> list[float]:
    times, toks = [], first
    for _ in range(n):
        t = time.perf_counter()
        logits = engine.decode(seqs, toks)
        times.append(time.perf_counter() - t)
        toks = logits.argmax(-1).tolist()
    return times


def llama_steps(llm, token: int, n: int) -> list[float]:
    """n single-token evals (the token fed does not change the cost of a step)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--weights", default="dense", choices=["dense", "int8"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--llama-threads", default="2,1",
                    help="llama.cpp decode threads to measure, comma-separated (its prefill uses 1)")
    ap.add_argument("--contexts", default="256,4000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (torch batch 1 / llama.cpp)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--json", default=None, help="write raw figures here")
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    ref = resolve(None)
    extra = args.steps * (args.rounds + 1) + 8
    per_seq = -(-(max(contexts) + extra) // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE  # whole blocks per sequence
    options = TorchOptions(device="cpu", dtype=DTYPES[args.dtype], weights=args.weights, threads=args.threads,
                           pool_tokens=max(batches) * per_seq).checked()
    loaded = load_model(ref, options)
    session = build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy(), max(contexts) + extra), options)
    engine, cache = session.engine, session.engine.cache
    llamas = {}
    if not args.no_llama:
        from llama_cpp import Llama
        for n in (int(x) for x in args.llama_threads.split(",")):
            llamas[n] = Llama(str(ref.path), n_ctx=max(contexts) + extra, n_threads=n, n_threads_batch=1,
                              n_batch=512, verbose=False)
    ids = long_text_ids(session.tokenizer, max(contexts))
    rows = []
    for ctx in contexts:
        cache.add_sequence(1, reserve_tokens=ctx + extra)  # as a batch admits a sequence
        t = time.perf_counter()
        last = engine.prefill(1, ids[:ctx])
        prefill_s = time.perf_counter() - t
        first = int(last.argmax())
        lt: dict[int, list[float]] = {n: [] for n in llamas}
        for llm in llamas.values():
            llm.reset()
            llm.eval(ids[:ctx])
        for b in batches:
            seqs = [1] + [100 + i for i in range(b - 1)]
            for s in seqs[1:]:
                fork(cache, 1, s, ctx + extra)
            tt: list[float] = []
            for _ in range(args.rounds if b == 1 else 1):
                tt += torch_steps(engine, seqs, [first] * b, args.steps)
                if b == 1:
                    for n, llm in llamas.items():
                        lt[n] += llama_steps(llm, first, args.steps)
            for s in seqs[1:]:
                cache.finish(s)
            cache.truncate(1, ctx)
            med = statistics.median(tt)
            rows.append({"context": ctx, "batch": b, "torch_step_ms": med * 1e3, "torch_tok_s": b / med,
                         "torch_prefill_tok_s": ctx / prefill_s,
                         "llamacpp_tok_s": {n: 1 / statistics.median(v) for n, v in lt.items()} if b == 1 else {}})
            print(json.dumps(rows[-1]), flush=True)
        cache.finish(1)
    report(rows, args, loaded.model.weight_bytes())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows, "torch_threads": torch.get_num_threads()}, fh, indent=1)


def report(rows: list[dict], args, weight_bytes: int) -> None:
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}, llama.cpp decode threads {args.llama_threads}")
    print(f"torch backend: {args.dtype} activations, {args.weights} weights "
          f"({weight_bytes / 2**20:.0f} MiB read per step); llama.cpp: the GGUF's Q4_1/Q8_0 weights\n")
    threads = [int(x) for x in args.llama_threads.split(",")] if not args.no_llama else []
    head = "".join(f" llama.cpp {n}t tok/s | torch / llama.cpp {n}t |" for n in threads)
    print("| context | batch | torch tok/s (aggregate) | torch step ms |" + head + " batch-B / batch-1 (torch) |")
    print("|---:|---:|---:|---:|" + "---:|---:|" * len(threads) + "---:|")
    for r in rows:
        b1 = next(x for x in rows if x["context"] == r["context"] and x["batch"] == 1)
        cells = ""
        for n in threads:
            llama = b1["llamacpp_tok_s"].get(n)
            ratio = f"{r['torch_tok_s'] / llama:.2f}×" if llama and r["batch"] == 1 else ""
            cells += f" {llama:.1f} | {ratio} |" if r["batch"] == 1 else " | |"
        print(f"| {r['context']} | {r['batch']} | {r['torch_tok_s']:.1f} | {r['torch_step_ms']:.0f} |{cells} "
              f"{r['torch_tok_s'] / b1['torch_tok_s']:.2f}× |")


if __name__ == "__main__":
    main()
