"""A long greedy generation with the real model through a windowed KV policy, checking that the
cache's bytes stay constant once the window is full (kvcache issue: 20,000 tokens with
int4+sink4+win2048 at constant KV bytes).

The bundled SmolLM2 runs on the torch backend (LOCALCTX_TORCH_DTYPE / _WEIGHTS / _THREADS
apply). After a prompt from Python's documentation, the model decodes ``--tokens`` tokens
greedily, one step per token; an end-of-sequence token does not stop it (the point is the
stream's length). Every step's KV bytes are compared with the cost model's prediction for the
tokens streamed so far; the script prints the bytes and tok/s every ``--every`` tokens and exits
non-zero if the bytes ever differ from the prediction or pass the cost model's peak. Once the
window is full the bytes only cycle through the few values of a quantization group's phases
(a quantized group leaves the window whole), the same values for the rest of the stream.

    python benchmarks/quality/kv_stream_generation.py --kv int4+sink4+win2048 --tokens 20000
"""
from __future__ import annotations

import argparse
import sys
import time

from localctx.backends.models.ref import resolve
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache import cost
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="int4+sink4+win2048")
    ap.add_argument("--tokens", type=int, default=20000, help="tokens to generate")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--every", type=int, default=1000, help="print a line every this many tokens")
    args = ap.parse_args(argv)

    policy = KVPolicy.parse(args.kv)
    if policy.capacity() is None:
        raise SystemExit(f"--kv {policy} keeps every token; give a policy with a window")
    ref = resolve(None)
    options = TorchOptions.from_env()
    loaded = load_model(ref, options)
    total = args.prompt_tokens + args.tokens
    session = build_session(loaded, Plan.fixed("torch", loaded.spec, policy, total), options)
    engine, cache, spec = session.engine, session.engine.cache, session.spec
    from pydoc_data.topics import topics
    prompt = session.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))[:args.prompt_tokens]

    cache.add_sequence(0)
    logits = engine.prefill(0, prompt)
    n = len(prompt)
    settle = policy.capacity() + 2 * policy.group_size  # tokens after which the window is full
    after_fill: set[int] = set()
    mismatches = 0
    peak = cost.max_kv_bytes(spec, policy, total)
    started = last_t = time.perf_counter()
    print(f"model {loaded.spec.name}, policy {policy}, {options.dtype} activations, {options.weights} weights; "
          f"cost model peak {format_bytes(peak)}", flush=True)
    print(f"{'streamed':>9} {'held tokens':>11} {'KV bytes':>10} {'predicted':>10} {'tok/s':>7}", flush=True)
    for i in range(1, args.tokens + 1):
        logits = engine.decode([0], [int(logits.argmax())])[0]  # greedy; [vocab] after prefill and decode
        n += 1
        held = cache.kv_bytes(0)
        predicted = cost.kv_bytes(spec, policy, n)
        mismatches += held != predicted
        if n >= settle:
            after_fill.add(held)
        if i % args.every == 0 or i == args.tokens:
            now = time.perf_counter()
            rate = args.every / (now - last_t) if i % args.every == 0 else float("nan")
            last_t = now
            print(f"{n:9,} {cache.kv_tokens(0):11,} {held:10,} {predicted:10,} {rate:7.1f}", flush=True)
    wall = time.perf_counter() - started
    print(f"{args.tokens:,} tokens in {wall:.0f} s ({args.tokens / wall:.1f} tok/s); "
          f"bytes after the window filled: {len(after_fill)} distinct values, "
          f"{min(after_fill, default=0):,}..{max(after_fill, default=0):,} (peak {peak:,}); "
          f"steps whose bytes differed from the cost model: {mismatches}")
    return 0 if mismatches == 0 and after_fill and max(after_fill) <= peak else 1


if __name__ == "__main__":
    sys.exit(main())
