"""A paired speed check of --backend mlx against plain llama.cpp (llama-cpp-python, default
f16 KV) on the same prompt, interleaved run by run so both see the same machine load:

    python benchmarks/speed/mlx_vs_llamacpp.py [-m MODEL] [--tokens 256] [--decode 16] [--reps 3]
                                               [--kv fp16 --kv int8 ...]

Prints one JSON object: per configuration the median prefill and decode tok/s, KV bytes, and
the ratio to llama.cpp measured in the same run."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from localctx.backends.base import GenerationParams
from localctx.backends.mlx.backend import MLXBackend
from localctx.backends.mlx.blas import use_system_openblas
from localctx.backends.models.spec_reader import read_spec
from localctx.backends.models.ref import resolve
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


def _prompt_tokens(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics
    text = " ".join(topics[k] for k in sorted(topics))
    tokens = tokenizer.encode(text)
    return tokens[:n]


def _mlx_run(session, tokens: list[int], n_decode: int) -> dict:
    session.reset()
    start = time.perf_counter()
    logits = session.feed(tokens)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n_decode):
        logits = session.feed([int(np.argmax(logits))])
    decode = time.perf_counter() - start
    return {"prefill_tok_s": len(tokens) / prefill, "decode_tok_s": n_decode / decode,
            "kv_bytes": session.cache.nbytes()}


def _llama_run(llm, tokens: list[int], n_decode: int) -> dict:
    llm.reset()
    start = time.perf_counter()
    llm.eval(tokens)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    decode = time.perf_counter() - start
    return {"prefill_tok_s": len(tokens) / prefill, "decode_tok_s": n_decode / decode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/speed/mlx_vs_llamacpp.py")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv", action="append", default=None)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    args = ap.parse_args(argv)
    import llama_cpp
    import mlx.core as mx

    ref = resolve(args.model)
    spec = read_spec(ref)
    policies = [KVPolicy.parse(k) for k in (args.kv or ["fp16", "int8", "int4+res128"])]
    backend = MLXBackend()
    sessions = {str(p): backend.load(ref, Plan.fixed("mlx", spec, p, args.tokens + args.decode + 8)) for p in policies}
    tokens = _prompt_tokens(next(iter(sessions.values())).tokenizer, args.tokens)
    llm = llama_cpp.Llama(model_path=str(ref.path), n_ctx=args.tokens + args.decode + 8, n_threads=args.threads,
                          logits_all=True, verbose=False)
    runs: dict[str, list[dict]] = {name: [] for name in ["llama.cpp", *sessions]}
    for _ in range(args.reps):
        runs["llama.cpp"].append(_llama_run(llm, tokens, args.decode))
        for name, session in sessions.items():
            runs[name].append(_mlx_run(session, tokens, args.decode))
    base = {k: statistics.median(r[k] for r in runs["llama.cpp"]) for k in ("prefill_tok_s", "decode_tok_s")}
    out = {"machine": f"{platform.machine()} {platform.system()}, Metal: {mx.metal.is_available()}",
           "blas": use_system_openblas().library or "bundled",  # what MLX's matmuls call (backends/mlx/blas.py)
           "model": spec.name, "prompt_tokens": len(tokens), "decode_tokens": args.decode, "reps": args.reps,
           "results": {}}
    for name, rs in runs.items():
        raw = {k: statistics.median(r[k] for r in rs) for k in ("prefill_tok_s", "decode_tok_s")}
        med = {k: round(v, 2) for k, v in raw.items()}
        med.update({f"{k}_vs_llama_cpp": round(raw[k] / base[k], 3) for k in raw})
        if name != "llama.cpp":
            med["kv_bytes"] = rs[-1]["kv_bytes"]
        out["results"][name] = med
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
