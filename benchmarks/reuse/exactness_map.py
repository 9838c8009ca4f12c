"""Where llama.cpp gives the same bits either way, by position in the text (docs/benchmarks-reuse.md).

Two checks, in a probe context of its own (``backends/llamacpp/speculate.ProbeContext``: the loaded
session's weights and context settings, 1,024 cells) with flash attention on and off:
- verify: after a text prefilled to position ``start``, the largest T ≤ 9 for which a T-row verify
  batch (and the one-token step after it) gives the logits of T one-token steps bit for bit, as
  ``speculate.exact_rows`` measures it (1: no draft is exact there);
- reuse: a text of N tokens prefilled in one batch, then cut back to P cached tokens and the rest
  prefilled as a second batch, against the cold prefill (``reuse_probe.reuse_logits``, as the session's
  probe runs it): is the logit row after the prefill and after each of 3 greedy steps bit-equal, and
  the largest difference if not (a prompt asked again is N - P = 1 in llama-cpp-python, 2 in localctx:
  session.REPLAY); ``--sweep`` lists, without flash attention, the rests of 1..20 tokens after a few
  lengths whose reuse is not exact.

    python benchmarks/reuse/exactness_map.py --kv fp16 --json docs/results/reuse/exactness-map-smollm2-fp16.json
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # bench_json
from bench_json import emit  # noqa: E402
from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.llamacpp import reuse_probe, speculate
from localctx.backends.llamacpp.speculate import ProbeContext, probe_tokens

CELLS = 1024
STARTS = (0, 6, 100, 200, 250, 300, 400, 600)
REUSE = [(40, 16), (80, 56), (100, 76), (200, 176), (300, 276), (500, 476)] + \
        [(n, n - d) for n in (200, 260, 300, 400, 500) for d in (1, 2)]


SWEEP_LENGTHS = (201, 257, 303, 403, 499)
SWEEP_RESTS = range(1, 21)


def verify_rows(probe: ProbeContext, tokens: list[int], start: int) -> int:
    return speculate.exact_rows_at(probe, tokens, start, 9)


def reuse(probe: ProbeContext, tokens: list[int], n: int, cut: int) -> dict:
    cold = reuse_probe.reuse_logits(probe, tokens[:n], None)
    warm = reuse_probe.reuse_logits(probe, tokens[:n], cut)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(cold, warm))
    return {"n": n, "cached": cut, "rest": n - cut, "exact": diff == 0.0, "max_abs_diff": round(diff, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="a GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--kv", default="fp16")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--sweep", action="store_true",
                    help=f"also every rest of 1..{max(SWEEP_RESTS)} tokens after {SWEEP_LENGTHS}, flash attention off")
    args = ap.parse_args(argv)
    result = {"command": "python benchmarks/reuse/exactness_map.py " + " ".join(sys.argv[1:]), "kv": args.kv,
              "cpus": os.cpu_count(), "cells": CELLS, "by_flash_attention": {}}
    with open_session(SessionRequest(model=args.model, backend="llamacpp", kv=args.kv, context=CELLS)) as s:
        result["model"] = s.spec.name
        result["session_flash_attention"] = s.settings.flash_attn
        tokens = probe_tokens(s.llm, max(STARTS) + 12)
        settings = (True,) if s.plan.policy.quantized else (True, False)  # quantized V needs flash attention
        for fa in settings:
            probe = ProbeContext(s.llm, max(max(STARTS), max(n for n, _ in REUSE)), CELLS, flash_attn=fa)
            try:
                verify = {str(start): verify_rows(probe, tokens, start) for start in STARTS}
                reused = [reuse(probe, tokens, n, cut) for n, cut in REUSE]
            finally:
                probe.close()
            result["by_flash_attention"]["on" if fa else "off"] = {"verify_exact_rows_at": verify, "reuse": reused}
            print(f"flash attention {'on' if fa else 'off'}: verify rows by start {verify}", file=sys.stderr)
        if args.sweep and not s.plan.policy.quantized:
            probe = ProbeContext(s.llm, max(SWEEP_LENGTHS), CELLS, flash_attn=False)
            try:
                result["sweep_flash_attention_off"] = {
                    str(n): [d for d in SWEEP_RESTS if not reuse(probe, tokens, n, n - d)["exact"]]
                    for n in SWEEP_LENGTHS}  # the rests whose reuse is not exact
            finally:
                probe.close()
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
