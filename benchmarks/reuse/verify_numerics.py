"""How far llama.cpp's multi-token verify rounds from its one-token step (docs/benchmarks-reuse.md).

The same token after the same cached prompt is evaluated as a one-token step and as the first row
of a T-token verify batch (``backends/llamacpp/speculate.py``); printed per T: the largest
absolute logit difference and whether the argmax agrees. T = 1 goes through the verify path too,
so a difference there would be a bug in it; for T ≥ 2 it is llama.cpp's batch kernels.

    python benchmarks/reuse/verify_numerics.py --kv fp16 --json docs/results/reuse/benchmarks-reuse-numerics.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.llamacpp.speculate import LlamaCppVerifier, last_logits

PROMPTS = ["Write a Python function that adds two numbers.", "Name three colours.",
           "Copy this sentence exactly: the quick brown fox jumps over the lazy dog."]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv", default="fp16")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    with open_session(SessionRequest(model=None, backend="llamacpp", kv=args.kv, context=1024)) as s:
        for text in PROMPTS:
            ids = s.tokenize([{"role": "user", "content": text}])
            s.reset()
            s.llm.eval(ids)
            token = int(np.argmax(last_logits(s.llm)))
            s.llm.eval([token])
            single = last_logits(s.llm)
            for T in (1, 2, 4, 8):
                s.reset()
                s.llm.eval(ids)
                verifier = LlamaCppVerifier(s.llm, 1024, None)
                first = verifier.step([token] * T)[0]
                verifier.close()
                rows.append({"prompt": text, "T": T, "max_abs_logit_diff": round(float(np.abs(first - single).max()), 4),
                             "same_argmax": int(np.argmax(first)) == int(np.argmax(single))})
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": "python benchmarks/reuse/verify_numerics.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "kv": args.kv, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
