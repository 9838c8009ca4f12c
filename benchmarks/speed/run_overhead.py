"""Does `localctx run` decode as fast as plain llama-cpp-python? Decode tok/s of `localctx run`
(llama.cpp backend, its own --json stats) beside plain llama-cpp-python on the same GGUF, same prompt,
same threads and n_ctx 8,192, greedy, interleaved run by run, at several prompt lengths. Plain runs
twice per round: with llama-cpp-python's default (flash attention off, as localctx opens fp16 KV
unless `localctx plan --calibrate` measured it faster with it) and with flash attention on (llama.cpp's
own default on a CPU, `--flash-attn auto`): the first ratio is what a user moving from plain
llama-cpp-python sees, the second localctx beside the other engine setting. Prints
a markdown table of medians of the per-round ratios; ``--json`` writes every run.

    python benchmarks/speed/run_overhead.py --runs 5 --contexts 256,4000 [-m MODEL.gguf] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

BASELINE = textwrap.dedent("""
    import json, sys, time
    from llama_cpp import Llama
    path, text, n_gen, threads, fa = sys.argv[1], sys.stdin.read(), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    llm = Llama(model_path=path, n_ctx=8192, n_threads=threads, n_batch=512, flash_attn=fa, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)
    stamps = []
    for tok in llm.generate(ids, top_k=0, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        if len(stamps) == n_gen or llm.token_eos() == tok:
            break
    print(json.dumps({"prompt_tokens": len(ids), "generated": len(stamps),
                      "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}))
""")


def prompt_of(n_tokens: int) -> str:
    import pydoc_data.topics as topics
    from llama_cpp import Llama

    from localctx.backends.models.ref import bundled_default_path

    text = "\n\n".join(topics.topics.values())
    llm = Llama(model_path=str(bundled_default_path()), n_ctx=64, vocab_only=True, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)[: n_tokens - 1]
    return llm.detokenize(ids).decode("utf-8", errors="ignore")


def run_localctx(model: str, text: str, n_gen: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "localctx.app.cli", "run", "--raw", "--json", "--backend", "llamacpp",
                          "-m", model, "--max-tokens", str(n_gen)], input=text, capture_output=True, text=True,
                         check=True)
    doc = json.loads(out.stdout)
    stats = doc["stats"]
    return {"prompt_tokens": stats["prompt_tokens"], "generated": stats["generated_tokens"],
            "decode_tok_s": stats["decode_tok_s"], "kv_layout": doc["kv_layout"]}


def run_plain(model: str, text: str, n_gen: int, threads: int, flash_attn: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", BASELINE, model, str(n_gen), str(threads), "1" if flash_attn else "0"],
                         input=text, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def main() -> None:
    from localctx.backends.llamacpp.session import default_threads
    from localctx.backends.models.ref import bundled_default_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--contexts", default="256,4000")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("-m", "--model", default=str(bundled_default_path()))
    ap.add_argument("--json", default=None, help="write every run and the medians here")
    args = ap.parse_args()
    threads = default_threads()
    rows = []
    print("| prompt tokens | localctx run tok/s | plain, flash attention off (its default) | ratio | "
          "plain, flash attention on | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        text = prompt_of(ctx)
        rounds = []
        for i in range(args.runs):  # the order rotates, so no side always runs first
            sides = [("ours", lambda: run_localctx(args.model, text, args.gen)),
                     ("plain_fa_off", lambda: run_plain(args.model, text, args.gen, threads, False)),
                     ("plain_fa_on", lambda: run_plain(args.model, text, args.gen, threads, True))]
            sides = sides[i % 3:] + sides[:i % 3]
            rounds.append({name: run() for name, run in sides})
        ours = [r["ours"]["decode_tok_s"] for r in rounds]
        off = [r["plain_fa_off"]["decode_tok_s"] for r in rounds]
        on = [r["plain_fa_on"]["decode_tok_s"] for r in rounds]
        row = {"prompt_tokens_asked": ctx, "rounds": rounds,
               "ratio_to_fa_off": round(statistics.median(a / b for a, b in zip(ours, off)), 3),
               "ratio_to_fa_on": round(statistics.median(a / b for a, b in zip(ours, on)), 3)}
        rows.append(row)
        print(f"| {rounds[0]['ours']['prompt_tokens']} | {spread(ours)} | {spread(off)} | {row['ratio_to_fa_off']:.2f} | "
              f"{spread(on)} | {row['ratio_to_fa_on']:.2f} |", flush=True)
    if args.json:
        doc = {"command": "python benchmarks/speed/run_overhead.py " + " ".join(sys.argv[1:]),
               "model": Path(args.model).name, "threads": threads, "generated": args.gen,
               "load_average_at_end": os.getloadavg(), "contexts": rows}
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
