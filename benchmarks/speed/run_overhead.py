"""Does the `localctx run` wrapper cost anything? Decode tok/s of `localctx run` (llama.cpp backend,
its own --json stats) beside plain llama-cpp-python on the same GGUF, same prompt, same threads and
n_ctx, interleaved run by run, at two prompt lengths. Prints a markdown table of medians.

    python benchmarks/speed/run_overhead.py --runs 5 --contexts 256,4000
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

BASELINE = textwrap.dedent("""
    import json, sys, time
    from llama_cpp import Llama
    path, text, n_gen, threads = sys.argv[1], sys.stdin.read(), int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model_path=path, n_ctx=8192, n_threads=threads, n_batch=512, verbose=False)
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


def run_localctx(text: str, n_gen: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "localctx.app.cli", "run", "--raw", "--json", "--backend", "llamacpp",
                          "--max-tokens", str(n_gen)], input=text, capture_output=True, text=True, check=True)
    stats = json.loads(out.stdout)["stats"]
    return {"prompt_tokens": stats["prompt_tokens"], "generated": stats["generated_tokens"],
            "decode_tok_s": stats["decode_tok_s"]}


def run_plain(text: str, n_gen: int, threads: int) -> dict:
    from localctx.backends.models.ref import bundled_default_path

    out = subprocess.run([sys.executable, "-c", BASELINE, str(bundled_default_path()), str(n_gen), str(threads)],
                         input=text, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--contexts", default="256,4000")
    ap.add_argument("--gen", type=int, default=128)
    args = ap.parse_args()
    from localctx.backends.llamacpp.session import default_threads

    threads = default_threads()
    print(f"| prompt tokens | localctx run decode tok/s (median) | llama-cpp-python decode tok/s (median) | ratio |")
    print("|---:|---:|---:|---:|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        text = prompt_of(ctx)
        ours, plain = [], []
        for _ in range(args.runs):
            ours.append(run_localctx(text, args.gen)["decode_tok_s"])
            plain.append(run_plain(text, args.gen, threads)["decode_tok_s"])
        ratios = [a / b for a, b in zip(ours, plain)]
        print(f"| {ctx} | {statistics.median(ours):.1f} ({min(ours):.1f}–{max(ours):.1f}) | "
              f"{statistics.median(plain):.1f} ({min(plain):.1f}–{max(plain):.1f}) | "
              f"{statistics.median(ratios):.2f} |", flush=True)


if __name__ == "__main__":
    main()
