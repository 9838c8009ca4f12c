"""Next-token logits of the torch backend against llama.cpp (llama-cpp-python) on the same GGUF,
for each torch dtype and weight format: Pearson correlation, the same top-5 set, the same argmax,
and the weight bytes one decode step reads (`weight_bytes()` of the loaded model). Deterministic; no timing. Prints one JSON
object (docs/benchmarks-torch.md); `--json PATH` also writes it there.

    python benchmarks/quality/torch_logits_vs_llamacpp.py --configs fp32:dense,bf16:dense,bf16:int8 --json out.json
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from localctx.backends.models.ref import resolve
from localctx.backends.torch.loading import DTYPES, TorchOptions, build_session, load_model
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy

PROMPT = "Give me three tips for writing clear Python code."  # the chat prompt of tests/backends/torch/test_torch_reference.py


def torch_logits(ref, dtype: str, weights: str) -> tuple[str, list[int], np.ndarray, int]:
    options = TorchOptions(device="cpu", dtype=DTYPES[dtype], weights=weights).checked()
    loaded = load_model(ref, options)
    step_bytes = loaded.model.weight_bytes()
    session = build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy(), 512), options)
    text = session.render([{"role": "user", "content": PROMPT}])
    ids = session.tokenizer.encode(text)
    session.engine.cache.add_sequence(1)
    try:
        logits = session.engine.prefill(1, ids).float().numpy()
    finally:
        session.engine.cache.finish(1)
    return text, ids, logits, step_bytes


def llama_logits(path: str, text: str, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=256, logits_all=True, n_threads=2, verbose=False)
    if llm.tokenize(text.encode(), add_bos=False, special=True) != ids:
        raise SystemExit("llama.cpp tokenizes the prompt differently; the logits would not be comparable")
    llm.eval(ids)
    return np.asarray(llm.scores[len(ids) - 1], dtype=np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="fp32:dense,bf16:dense,bf16:int8", help="dtype:weights, comma-separated")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    ref = resolve(None)
    rows, theirs = [], None
    for config in args.configs.split(","):
        dtype, weights = config.split(":")
        text, ids, ours, step_bytes = torch_logits(ref, dtype, weights)
        if theirs is None:
            theirs = llama_logits(str(ref.path), text, ids)
        rows.append({"dtype": dtype, "weights": weights, "weight_bytes_per_step": step_bytes,
                     "correlation": float(np.corrcoef(ours, theirs)[0, 1]),
                     "same_top5_set": set(np.argsort(-ours)[:5].tolist()) == set(np.argsort(-theirs)[:5].tolist()),
                     "same_argmax": int(np.argmax(ours)) == int(np.argmax(theirs)),
                     "prompt_tokens": len(ids)})
    result = {"command": "python benchmarks/quality/torch_logits_vs_llamacpp.py --configs " + args.configs,
              "model": ref.path.name, "prompt": PROMPT, "torch": torch.__version__, "rows": rows}
    out = json.dumps(result, indent=1)
    print(out)
    if args.json:
        with open(args.json, "w") as f:
            f.write(out + "\n")


if __name__ == "__main__":
    main()
