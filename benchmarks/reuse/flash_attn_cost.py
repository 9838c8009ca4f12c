"""What llama.cpp's flash attention costs plain decoding with an fp16 KV cache, per cached length.

Two contexts on the same GGUF (flash attention off / on, f16 keys and values, everything else as a
localctx session opens them) are filled with the same text to each length in turn; at each length
one-token decode steps (evaluate one token at position n, then drop it again, so every sample sees
n cached tokens) are timed in interleaved rounds, so load from other processes hits both alike.
Printed per length: the median tok/s of each and their ratio (on ÷ off; > 1: flash attention is
faster). Also the prefill rate of each for the first stretch.

    python benchmarks/reuse/flash_attn_cost.py MODEL.gguf --json docs/results/reuse/flash-attn-cost-NAME.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    import llama_cpp
    from llama_cpp import Llama

    from localctx.backends.llamacpp.session import default_threads, quiet_stderr

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--lengths", default="128,512,2048", help="cached tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=6, help="timed steps per context per round")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    threads = args.threads or default_threads()
    llms = {}
    for fa in (False, True):
        with quiet_stderr():
            llms[fa] = Llama(model_path=str(args.model), n_ctx=max(lengths) + 16, n_threads=threads,
                             n_threads_batch=threads, n_batch=512, type_k=llama_cpp.GGML_TYPE_F16,
                             type_v=llama_cpp.GGML_TYPE_F16, flash_attn=fa, verbose=False)
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics.values())
    ids = llms[False].tokenize(text.encode(), add_bos=True, special=False)[: max(lengths) + 1]
    rows, filled = [], 0
    for n in lengths:
        prefill = {}
        for fa, llm in llms.items():
            t0 = time.perf_counter()
            llm.eval(ids[filled:n])
            prefill[fa] = (n - filled) / (time.perf_counter() - t0)
        samples = {False: [], True: []}
        for r in range(args.rounds):
            for fa in ((False, True) if r % 2 == 0 else (True, False)):
                llm = llms[fa]
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    llm.eval([ids[n]])
                    samples[fa].append(time.perf_counter() - t0)
                    llm._ctx.kv_cache_seq_rm(-1, n, -1)
                    llm.n_tokens = n
        off, on = (1 / statistics.median(samples[fa]) for fa in (False, True))
        rows.append({"cached_tokens": n, "off_tok_s": round(off, 1), "on_tok_s": round(on, 1),
                     "on_over_off": round(on / off, 3), "prefill_tok_s": {"off": round(prefill[False], 1),
                                                                            "on": round(prefill[True], 1)},
                     "load_average": round(os.getloadavg()[0], 2)})
        print(json.dumps(rows[-1]), flush=True)
        filled = n
    for llm in llms.values():
        llm.close()
    if args.json:
        args.json.write_text(json.dumps({
            "command": "python benchmarks/reuse/flash_attn_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": args.model.name, "threads": threads, "rounds": args.rounds, "steps": args.steps,
            "cpus": os.cpu_count(), "llama_cpp_python": llama_cpp.__version__,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
