"""Benchmark: ``localctx summarize`` against the naive approach on a corpus of long documents.

The corpus is built from Python's own ``pydoc_data.topics`` (no downloads): ``--docs`` documents
whose lengths run evenly from ``--min-tokens`` to ``--max-tokens`` (SmolLM2 tokens). The naive
approach is one llama-cpp-python chat completion per document with the document truncated to
what fits the context (everything past it is lost); localctx summarize chunks every document,
batches chunks across documents and map-reduces. Both use the same model file, context, thread
count, answer length and greedy decoding, in the same process, one after the other (the order
alternates between repeats). Reported per method: wall seconds (model load excluded), document
tokens, tokens actually read, coverage, and input tokens per second (tokens read / wall).

``--naive`` picks the naive baselines, each measured in the same run as localctx so every ratio is
paired: ``llama-cpp-python`` (the library called directly on the same GGUF) and ``session`` (the
same localctx session as the localctx run, one ``Session.generate`` per truncated document: the
same engine, weights and threads, without chunking or batching). On ``--backend llamacpp`` both
are llama.cpp; on ``--backend torch`` only ``session`` is the same engine.

    python benchmarks/speed/summarize_bench.py --docs 20 --min-tokens 4000 --max-tokens 30000
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

from localctx.app.summarize.pipeline import BatchConfig, summarize
from localctx.app.summarize.events import JsonEvents
from localctx.app.summarize.jobs import Settings
from localctx.app.summarize.prompts import load_prompts
from localctx.backends.base import GenerationParams
from localctx.backends.llamacpp.session import LlamaCppSession, quiet_stderr
from localctx.backends.models.spec_reader import read_spec
from localctx.backends.models.ref import resolve
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


NAIVE_METHODS = ("llama-cpp-python", "session")


def truncated_documents(llm, count_messages, folder: Path, docs: dict[str, int], context: int, answer: int):
    """(name, text that fits, tokens kept) per document: everything past the context is dropped."""
    prompts = load_prompts()
    for name in docs:
        text = (folder / name).read_text(encoding="utf-8")
        overhead = count_messages(prompts.messages("whole", title=name, text=""))
        keep = context - overhead - answer - 16
        ids = llm.tokenize(text.encode(), add_bos=False)
        if len(ids) > keep:  # the naive run drops everything past the context
            text = llm.detokenize(ids[:keep]).decode("utf-8", errors="ignore")
        yield name, prompts.messages("whole", title=name, text=text), min(len(ids), keep)


def run_naive_llama(llm, documents: list, answer: int) -> dict:
    """One llama-cpp-python chat completion per (truncated) document."""
    read = 0
    start = time.perf_counter()
    for _name, messages, kept in documents:
        read += kept
        llm.reset()
        llm.create_chat_completion(messages, max_tokens=answer, temperature=0.0)
    return {"wall_s": time.perf_counter() - start, "tokens_read": read}


def run_naive_session(session, documents: list, answer: int) -> dict:
    """One ``Session.generate`` per (truncated) document on localctx's own session: same engine."""
    read = 0
    params = GenerationParams(max_tokens=answer, temperature=0.0)
    start = time.perf_counter()
    for _name, messages, kept in documents:
        read += kept
        session.reset()
        for _event in session.generate(messages, params):
            pass
    return {"wall_s": time.perf_counter() - start, "tokens_read": read}


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
                    help="localctx's backend; torch reads LOCALCTX_TORCH_DTYPE / _WEIGHTS / _THREADS")
    ap.add_argument("--naive", default="llama-cpp-python",
                    help="comma-separated naive baselines, each paired with localctx in the same run: "
                         "llama-cpp-python (the library on the same GGUF) and/or session (localctx's own "
                         "session, one generate per truncated document: same engine and weights)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results here too")
    args = ap.parse_args(argv)
    naive_methods = [m.strip() for m in args.naive.split(",") if m.strip()]
    if not naive_methods or any(m not in NAIVE_METHODS for m in naive_methods):
        ap.error(f"--naive {args.naive!r}: choose from {', '.join(NAIVE_METHODS)}")

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
    documents = list(truncated_documents(naive_llm, session.count_tokens, corpus, docs, args.context,
                                         args.summary_tokens))
    naive_names = {"llama-cpp-python": "naive_llama_cpp_python", "session": f"naive_{args.backend}"}
    methods = [naive_names[m] for m in naive_methods] + ["localctx"]
    runs = {method: [] for method in methods}
    for r in range(args.repeats):
        order = methods if r % 2 == 0 else list(reversed(methods))
        for method in order:
            if method == "naive_llama_cpp_python":
                res = run_naive_llama(naive_llm, documents, args.summary_tokens)
            elif method.startswith("naive_"):
                res = run_naive_session(session, documents, args.summary_tokens)
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
    # each ratio: localctx over one naive baseline, from the same run (medians over repeats)
    ratios = {method: summary["localctx"]["input_tok_s"] / summary[method]["input_tok_s"]
              for method in methods if method != "localctx"}
    result = {"corpus_tokens": total, "documents": len(docs), "args": vars(args), "threads": threads,
              "median": summary, "ratio_input_tok_s": ratios, "runs": runs}
    print(f"{'method':24} {'wall s':>9} {'read':>9} {'coverage':>9} {'in tok/s':>9}")
    for method, s in summary.items():
        print(f"{method:24} {s['wall_s']:9.1f} {s['tokens_read']:9,} {s['coverage']:9.1%} {s['input_tok_s']:9.1f}")
    for method, ratio in ratios.items():
        print(f"localctx / {method} input tok/s: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    session.close()
    naive_llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
