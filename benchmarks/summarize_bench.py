"""Benchmark: ``localctx summarize`` against the naive approach on a corpus of long documents.

The corpus is built from Python's own ``pydoc_data.topics`` (no downloads): ``--docs`` documents
whose lengths run evenly from ``--min-tokens`` to ``--max-tokens`` (SmolLM2 tokens). The naive
approach is one llama-cpp-python chat completion per document with the document truncated to
what fits the context (everything past it is lost); localctx summarize chunks every document,
batches chunks across documents and map-reduces. Both use the same model file, context, thread
count, answer length and greedy decoding, in the same process, one after the other (the order
alternates between repeats). Reported per method: wall seconds (model load excluded), document
tokens, tokens actually read, coverage, and input tokens per second (tokens read / wall).

    PYTHONPATH=.dev python benchmarks/summarize_bench.py --docs 20 --min-tokens 4000 --max-tokens 30000
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from localctx.app.summarize.batch import BatchConfig, summarize
from localctx.app.summarize.events import JsonEvents
from localctx.app.summarize.jobs import Settings
from localctx.app.summarize.prompts import load_prompts
from localctx.backends.llamacpp import LlamaCppSession, quiet_stderr
from localctx.backends.model_spec import read_spec
from localctx.backends.modelref import resolve
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


def build_corpus(folder: Path, n_docs: int, lo: int, hi: int, count) -> dict[str, int]:
    import pydoc_data.topics as topics
    keys = sorted(topics.topics)
    sections = [f"{k}\n{'*' * len(k)}\n\n{topics.topics[k].strip()}\n\n" for k in keys]
    sizes = [count(s) for s in sections]
    docs, cursor = {}, 0
    for i in range(n_docs):
        target = lo + (hi - lo) * i // max(1, n_docs - 1)
        parts, total = [], 0
        while total < target:
            section, size = sections[cursor % len(sections)], sizes[cursor % len(sections)]
            cursor += 1
            if total + size > target:  # take the section's paragraphs up to the target
                paragraphs = section.split("\n\n")
                for k in range(1, len(paragraphs) + 1):
                    if total + count("\n\n".join(paragraphs[:k])) > target:
                        break
                section = "\n\n".join(paragraphs[:k]) + "\n\n"
                size = count(section)
            parts.append(section)
            total += size
        name = f"doc{i:02d}.txt"
        (folder / name).write_text("".join(parts), encoding="utf-8")
        docs[name] = count("".join(parts))
    return docs


def run_naive(llm, count_messages, folder: Path, docs: dict[str, int], context: int, answer: int) -> dict:
    prompts = load_prompts()
    read = 0
    start = time.perf_counter()
    for name in docs:
        text = (folder / name).read_text(encoding="utf-8")
        overhead = count_messages(prompts.messages("whole", title=name, text=""))
        keep = context - overhead - answer - 16
        ids = llm.tokenize(text.encode(), add_bos=False)
        if len(ids) > keep:  # the naive run drops everything past the context
            text = llm.detokenize(ids[:keep]).decode("utf-8", errors="ignore")
        read += min(len(ids), keep)
        llm.reset()
        llm.create_chat_completion(prompts.messages("whole", title=name, text=text), max_tokens=answer,
                                   temperature=0.0)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens_read": read}


def run_localctx(session, folder: Path, out: Path, settings: Settings) -> dict:
    config = BatchConfig(paths=(str(folder),), out_dir=out, settings=settings, model_id="bench")
    start = time.perf_counter()
    report = summarize(config, session, JsonEvents(io.StringIO()))
    wall = time.perf_counter() - start
    assert report["counts"]["done"] == len(list(folder.iterdir())), report["counts"]
    totals = report["totals"]
    return {"wall_s": wall, "tokens_read": totals["covered_tokens"], "calls": totals["calls"],
            "batches": totals["batches"], "widest_batch": totals["widest_batch"],
            "generated_tokens": totals["generated_tokens"],
            "max_depth": max(d.get("depth", 0) for d in report["documents"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--min-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=30000)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--summary-tokens", type=int, default=128)
    ap.add_argument("--chunk-tokens", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads for both runs")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--backend", default="llamacpp", choices=["llamacpp", "torch"],
                    help="localctx's backend (the naive run is always llama-cpp-python); torch reads "
                         "LOCALCTX_TORCH_DTYPE / _WEIGHTS / _THREADS")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results here too")
    args = ap.parse_args(argv)

    from llama_cpp import Llama
    ref = resolve(args.model)
    spec = read_spec(ref)
    plan = Plan.fixed(args.backend, spec, KVPolicy(), args.context, reason="benchmark")
    if args.backend == "llamacpp":
        session = LlamaCppSession(ref, plan, threads=args.threads)
        # LlamaCppSession sets n_threads only, so llama.cpp's batch threads (used for prefill and for
        # any multi-token decode) default to every CPU; the batched contexts copy these params: give
        # both runs the same thread count for both phases.
        session.llm.context_params.n_threads_batch = session.llm.n_threads
        threads = session.llm.n_threads
    else:
        from localctx.backends import registry
        session = registry.get("torch").load(ref, plan)
        threads = args.threads or 2
    with quiet_stderr():
        naive_llm = Llama(model_path=str(ref.path), n_ctx=args.context, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)
    settings = Settings(summary_tokens=args.summary_tokens, chunk_tokens=args.chunk_tokens, max_batch=args.batch)
    work = Path(tempfile.mkdtemp(prefix="lcx-sumbench-"))
    corpus = work / "corpus"
    corpus.mkdir()
    docs = build_corpus(corpus, args.docs, args.min_tokens, args.max_tokens,
                        lambda s: len(naive_llm.tokenize(s.encode(), add_bos=False)))
    total = sum(docs.values())
    print(f"corpus: {len(docs)} documents, {total:,} tokens ({min(docs.values()):,}..{max(docs.values()):,}); "
          f"context {args.context}, answer {args.summary_tokens} tokens, threads {threads}, localctx backend {args.backend}",
          file=sys.stderr)
    runs = {"naive": [], "localctx": []}
    for r in range(args.repeats):
        order = ["naive", "localctx"] if r % 2 == 0 else ["localctx", "naive"]
        for method in order:
            if method == "naive":
                res = run_naive(naive_llm, session.count_tokens, corpus, docs, args.context, args.summary_tokens)
            else:
                res = run_localctx(session, corpus, work / f"out{r}", settings)
            res["input_tok_s"] = res["tokens_read"] / res["wall_s"]
            runs[method].append(res)
            print(f"repeat {r} {method}: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()})}",
                  file=sys.stderr)
    summary = {}
    for method, results in runs.items():
        summary[method] = {
            "wall_s": statistics.median(x["wall_s"] for x in results),
            "tokens_read": results[0]["tokens_read"], "coverage": results[0]["tokens_read"] / total,
            "input_tok_s": statistics.median(x["input_tok_s"] for x in results)}
    ratio = summary["localctx"]["input_tok_s"] / summary["naive"]["input_tok_s"]
    result = {"corpus_tokens": total, "documents": len(docs), "args": vars(args), "median": summary,
              "ratio_input_tok_s": ratio, "runs": runs}
    print(f"{'method':10} {'wall s':>9} {'read':>9} {'coverage':>9} {'in tok/s':>9}")
    for method, s in summary.items():
        print(f"{method:10} {s['wall_s']:9.1f} {s['tokens_read']:9,} {s['coverage']:9.1%} {s['input_tok_s']:9.1f}")
    print(f"localctx / naive input tok/s: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    session.close()
    naive_llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
