"""Benchmark: the prompt cache on disk and prompt-lookup speculative decoding (docs/benchmarks-reuse.md).

1. **Second question about a long document.** The document is built from Python's
   ``pydoc_data.topics`` (no download), cut to ``--doc-tokens``. Per backend and KV policy, in a
   fresh cache directory: a session with the prompt cache answers question 1 (writing the
   document's KV); a *cold* session (prompt cache off) answers question 2; right after it a *new*
   session answers question 2 again, loading the document's KV from disk (the two timed runs sit
   side by side; the load average after each run is recorded, as the machine may be shared). Reported: time to first token of both
   question-2 runs, whether their greedy answers are identical, and the file's size against the
   cost model's KV bytes for the tokens it holds.
2. **Prompt lookup.** One prompt per task, greedy, ``--speculate off`` and ``ngram`` alternating
   (ngram, not auto: auto stays off on llama.cpp), ``--repeats`` pairs; reported: decode tok/s of each, the ratio, tokens per step,
   and whether the outputs are identical. The extractive task asks the model to copy a passage
   with one word changed; the free-form task asks for a short story.

    python benchmarks/reuse/reuse_bench.py --json docs/results/reuse/benchmarks-reuse.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.kvcache import cost, prompt_cache
from localctx.kvcache.hardware_profile import CACHE_ENV

QUESTIONS = ("What does the document say about the 'with' statement?",
             "Which section of the document describes assignment expressions?")
EXTRACT = ("Copy the following text exactly, word for word, but write 'function' instead of 'callable':\n\n")
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def document(session, n_tokens: int) -> str:
    import pydoc_data.topics as topics

    text = "".join(f"{k}\n\n{topics.topics[k].strip()}\n\n" for k in sorted(topics.topics))
    lo, hi = 0, len(text)
    while hi - lo > 200:  # the longest cut under n_tokens, to a few tokens
        mid = (lo + hi) // 2
        if session.count_tokens(text[:mid]) <= n_tokens:
            lo = mid
        else:
            hi = mid
    return text[:lo]


LOADS: list[float] = []  # the 1-minute load average after each timed answer (a shared machine skews figures)


def ask(session, prompt, max_tokens: int, speculate: str = "off") -> tuple[str, object]:
    pieces, last = [], None
    for event in session.generate(prompt, GenerationParams(max_tokens=max_tokens, speculate=speculate)):
        pieces.append(event.text)
        last = event
    LOADS.append(round(os.getloadavg()[0], 2))
    return "".join(pieces), last.stats


def request(backend: str, kv: str, args, cached: bool) -> SessionRequest:
    return SessionRequest(model=args.model, backend=backend, kv=kv, context=args.context, prompt_cache=cached)


def ttft_case(backend: str, kv: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[CACHE_ENV] = tmp
        with open_session(request(backend, kv, args, True)) as s:  # question 1 writes the file
            doc = document(s, args.doc_tokens)
            q = [[{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}] for question in QUESTIONS]
            _, first = ask(s, q[0], args.answer_tokens)
        [entry] = prompt_cache.entries()
        with open_session(request(backend, kv, args, False)) as s:  # cold, right before the cached run
            cold_text, cold = ask(s, q[1], args.answer_tokens)
        with open_session(request(backend, kv, args, True)) as s:
            hit_text, hit = ask(s, q[1], args.answer_tokens)
            n_file = int(entry.meta["n_tokens"])
            kv_bytes = int(entry.meta["kv_bytes"])
            model_kv = (cost.kv_bytes(s.spec, s.plan.policy, n_file) if backend == "torch"
                        else n_file * s.kv_state()[0] // max(1, s.kv_state()[1]))
    return {"backend": backend, "kv": kv, "prompt_tokens": cold.prompt_tokens,
            "cold_ttft_s": round(cold.prefill_s, 3), "first_question_ttft_s": round(first.prefill_s, 3),
            "cached_ttft_s": round(hit.prefill_s, 3), "speedup": round(cold.prefill_s / hit.prefill_s, 1),
            "loaded_tokens": hit.loaded_tokens, "identical": hit_text == cold_text,
            "file_tokens": n_file, "file_bytes": entry.size, "cache_kv_bytes": kv_bytes,
            "cost_model_kv_bytes": model_kv, "overhead_bytes": entry.size - model_kv,
            "load_avg_after_first_cold_cached": LOADS[-3:]}


def spec_case(backend: str, kv: str, task: str, prompt: str, mode: str, args) -> dict:
    runs = {"off": [], mode: []}
    texts = {}
    with open_session(request(backend, kv, args, False)) as s:
        for i in range(args.repeats):
            for m in (("off", mode) if i % 2 == 0 else (mode, "off")):
                s.reset()
                text, stats = ask(s, [{"role": "user", "content": prompt}], args.gen_tokens, m)
                runs[m].append(stats)
                texts[m] = text
    off = statistics.median(st.decode_tok_s for st in runs["off"])
    on = statistics.median(st.decode_tok_s for st in runs[mode])
    last = runs[mode][-1]
    return {"backend": backend, "kv": kv, "task": task, "mode": mode, "generated_tokens": last.generated_tokens,
            "off_decode_tok_s": round(off, 1), "on_decode_tok_s": round(on, 1), "ratio": round(on / off, 2),
            "off_runs_tok_s": [round(st.decode_tok_s, 1) for st in runs["off"]],
            "on_runs_tok_s": [round(st.decode_tok_s, 1) for st in runs[mode]],
            "tokens_per_step": round(last.tokens_per_step, 2), "accepted": last.accepted_tokens,
            "drafted": last.drafted_tokens, "identical": texts["off"] == texts[mode],
            "load_avg_after_each": LOADS[-2 * args.repeats:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None, help="a GGUF (default: the bundled SmolLM2)")
    p.add_argument("--backends", default="llamacpp,torch")
    p.add_argument("--ttft-kv", default="fp16,int4", help="KV policies of the document runs")
    p.add_argument("--spec-kv", default="fp16")
    p.add_argument("--doc-tokens", type=int, default=7600)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip", default="", help="comma list of parts to skip: ttft, spec")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import pydoc_data.topics as topics

    passage = topics.topics["calls"].strip()[:1500]
    out = {"command": "python benchmarks/reuse/reuse_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "ttft": [], "speculation": []}
    for backend in args.backends.split(","):
        if "ttft" not in args.skip:
            for kv in args.ttft_kv.split(","):
                row = ttft_case(backend, kv, args)
                print(json.dumps(row), flush=True)
                out["ttft"].append(row)
        if "spec" not in args.skip:
            for kv in args.spec_kv.split(","):
                for task, prompt, mode in (("extractive", EXTRACT + passage, "ngram"), ("free-form", STORY, "ngram")):
                    row = spec_case(backend, kv, task, prompt, mode, args)
                    print(json.dumps(row), flush=True)
                    out["speculation"].append(row)
    out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
