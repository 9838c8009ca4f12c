"""What chunked prefill costs in the policy cache's attention: CPU seconds (best of two, one
thread) of one layer of SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64)
over 2,048 tokens of random q/k/v, per policy and chunk size. Only the cache runs (no model), so
the figure isolates what the cache does per chunk. Run it on two checkouts to compare them:

    python benchmarks/quality/prefill_chunk_timing.py --json docs/results/quality/prefill-chunk-timing.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from localctx.backends.torch.rope import Rope
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache

POLICIES = ("int8", "int4+res128", "fp16+sink4+win1024", "int4+sink4+win1024")
N_TOKENS, N_HEADS, N_KV_HEADS, HEAD_DIM = 2048, 9, 3, 64


def seconds(policy: KVPolicy, chunk: int, q, k, v) -> float:
    cache = PolicyKVCache(PolicyCacheShape(1, N_KV_HEADS, HEAD_DIM), policy, Rope(HEAD_DIM, 10000.0))
    cache.add_sequence(0)
    started = time.process_time()
    for s in range(0, N_TOKENS, chunk):
        cache.begin_step([0], chunk)
        cache.attend(0, q[:, s:s + chunk], k[:, s:s + chunk], v[:, s:s + chunk])
        cache.end_step()
    return time.process_time() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here (atomically)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, N_TOKENS, h, HEAD_DIM, generator=gen) for h in (N_HEADS, N_KV_HEADS, N_KV_HEADS))
    rows = [{"policy": text, "chunk": chunk,
             "cpu_seconds": round(min(seconds(KVPolicy.parse(text), chunk, q, k, v) for _ in range(2)), 3)}
            for text in POLICIES for chunk in (64, 512)]
    out = {"tokens": N_TOKENS, "heads": N_HEADS, "kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM, "threads": 1,
           "rows": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.json)) or ".")
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
