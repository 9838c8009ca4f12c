"""One decode step's cache work on the MLX backend's mlx-lm graph, without the model: for every layer of
SmolLM2-135M's shape (30 layers, 3 KV heads, 9 query heads, head dim 64) append one token's keys and
values to a cache already holding ``n`` tokens and attend one query over it, evaluated per step:

    python benchmarks/speed/mlx_cache_step.py [--contexts 160,1024] [--steps 48] [--reps 3] [--variants ...]

- ``localctx``: lm_cache.PolicyKVCache at fp16 (float16 rows written in place, backends/mlx/full_rows.py;
  attention over them cast to the queries' float32);
- ``localctx-concat``: the same cache growing by one row at a time (``full_step`` 1: every append copies
  every held row into a new array, as the cache did before full_rows.py);
- ``mlx-lm``: mlx-lm's KVCache (float32 rows, the model's dtype off Metal, written in place) and
  ``mx.fast.scaled_dot_product_attention``, as ``mlx_lm.generate`` runs it;
- ``cast-only``: converting the held float16 keys and values to float32, the one step localctx's fp16
  attention has that mlx-lm's has not;
- with ``--variants``, also ``int4`` (lm_cache.PolicyKVCache at int4, full precision in float32),
  ``int4-fresh`` (the same, building its quantized store's dense keys and values anew at every step,
  as a cache does for a model that attends on its own and as every cache did before 2026-12-07) and
  ``mlx-lm-int4`` (mlx-lm's QuantizedKVCache, 4 bits, group 64).

Prints one JSON object: median milliseconds per step (all 30 layers) per variant and context."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import mlx.core as mx

from localctx.backends.mlx.lm_cache import PolicyKVCache, _routed_attention, route_attention
from localctx.backends.mlx.policy_cache import CacheShape
from localctx.kvcache.policy import KVPolicy

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 30, 3, 9, 64


VARIANTS = ("localctx", "localctx-concat", "mlx-lm", "cast-only")  # the default
ALL_VARIANTS = VARIANTS + ("int4", "int4-fresh", "mlx-lm-int4")


def caches(variant: str) -> list:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if variant == "mlx-lm":
        return [KVCache() for _ in range(LAYERS)]
    if variant == "mlx-lm-int4":
        return [QuantizedKVCache(group_size=64, bits=4) for _ in range(LAYERS)]
    if variant in ("int4", "int4-fresh"):
        out = [PolicyKVCache(KVPolicy.parse("int4"), CacheShape(KV_HEADS, HEAD_DIM, mx.float32, False))
               for _ in range(LAYERS)]
        for c in out:
            c.attends_itself = variant == "int4-fresh"
        return out
    out = [PolicyKVCache(KVPolicy(), CacheShape(KV_HEADS, HEAD_DIM, mx.float16, False)) for _ in range(LAYERS)]
    if variant == "localctx-concat":
        for c in out:
            c.full_step = 1
    return out


def held(cache) -> list[mx.array]:
    if isinstance(cache, PolicyKVCache):
        return [cache.full.k, cache.full.v, *cache.store.arrays()]
    if isinstance(cache.keys, tuple):  # mlx-lm's QuantizedKVCache: (codes, scales, biases)
        return [*cache.keys, *cache.values]
    return [cache.keys, cache.values]


def step_ms(variant: str, n: int, steps: int) -> float:
    layers = caches("localctx" if variant == "cast-only" else variant)
    prompt = mx.random.normal((1, KV_HEADS, n, HEAD_DIM), key=mx.random.key(0))
    for c in layers:
        c.update_and_fetch(prompt, prompt)
        if isinstance(c, PolicyKVCache):
            c.held = None
    mx.eval([a for c in layers for a in held(c)])
    q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM), key=mx.random.key(1))
    k = mx.random.normal((1, KV_HEADS, 1, HEAD_DIM), key=mx.random.key(2))
    mx.eval(q, k)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        if variant == "cast-only":
            outs = [a.astype(mx.float32) for c in layers for a in (c.k_full, c.v_full)]
        else:
            outs = []
            for c in layers:
                keys, values = c.update_and_fetch(k, k)
                outs.append(_routed_attention(q, keys, values, c, HEAD_DIM ** -0.5, None))
            outs += [a for c in layers for a in held(c)]
        mx.eval(outs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/speed/mlx_cache_step.py")
    ap.add_argument("--contexts", default="160,1024")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {','.join(ALL_VARIANTS)}")
    args = ap.parse_args(argv)
    route_attention()
    contexts = [int(c) for c in args.contexts.split(",")]
    variants = tuple(args.variants.split(","))
    unknown = set(variants) - set(ALL_VARIANTS)
    if unknown:
        ap.error(f"unknown variant {sorted(unknown)[0]!r}; choose from {', '.join(ALL_VARIANTS)}")
    runs = {v: {n: [] for n in contexts} for v in variants}
    load_before = os.getloadavg()
    for _ in range(args.reps):
        for n in contexts:
            for v in variants:
                runs[v][n].append(round(step_ms(v, n, args.steps), 3))
                print(f"{v} at {n}: {runs[v][n][-1]:.2f} ms", file=sys.stderr, flush=True)
    given = sys.argv[1:] if argv is None else argv
    out = {"command": " ".join(["python benchmarks/speed/mlx_cache_step.py", *given]), "host": platform.platform(),
           "cpu_count": os.cpu_count(), "mlx": mx.__version__, "metal": mx.metal.is_available(),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "median_ms_per_step": {v: {str(n): statistics.median(r) for n, r in by_n.items()} for v, by_n in runs.items()},
           "runs_ms": {v: {str(n): r for n, r in by_n.items()} for v, by_n in runs.items()}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
