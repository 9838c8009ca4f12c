"""Torch against llama.cpp along one long prompt: the next-token logits every ``--every`` tokens
of a passkey prompt (the one `localctx eval` builds for that length at depth 0.5), both prefilled
in 256-token chunks with an fp16 KV policy, then Pearson correlation, the same top-5 set and the
same argmax at each checkpoint, and the top-5 (token, logit) of both at the last position (the
answer's first token). It tells a model that is unsure at that length from a backend that goes
wrong past some position. Deterministic; no timing. Gemma 3 270M by default (the figures of
docs/quality.md):

    python benchmarks/long_logits_vs_llamacpp.py --length 16384 --json docs/quality-gemma3-long-logits-16k.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_json import emit  # noqa: E402
from quality_tables import gemma3_gguf  # noqa: E402

from localctx.app.session_options import SessionRequest, resolve_model  # noqa: E402
from localctx.backends import eval_tasks  # noqa: E402
from localctx.backends.eval_tasks import NeedleTask  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

CHUNK = 256


def checkpoints(n: int, every: int) -> list[int]:
    return sorted({*range(every, n, every), n})


def llamacpp_rows(model: str, length: int, every: int) -> tuple[list[int], dict[int, np.ndarray]]:
    from localctx.backends.llamacpp_evaluate import LlamaCppEvaluator

    ref, _ = resolve_model(SessionRequest(model=model, backend="llamacpp"))
    ev = LlamaCppEvaluator(ref, threads=1)
    _, _, _, ids = next(eval_tasks.passkey_cells(ev.tokenizer, NeedleTask(lengths=(length,), depths=(0.5,))))
    session = ev.session(KVPolicy.parse("fp16"), len(ids) + 8)
    marks, rows = set(checkpoints(len(ids), every)), {}
    for start in range(0, len(ids), CHUNK):  # chunks end at every checkpoint: every is a multiple of CHUNK
        end = min(start + CHUNK, len(ids))
        logits = ev._decode(session, ids[start:end], all_logits=False)
        if end in marks:
            rows[end] = logits[0].astype(np.float64)
    return ids, rows


def torch_rows(model: str, length: int, every: int) -> tuple[list[int], dict[int, np.ndarray]]:
    import torch

    from localctx.backends.torch.evaluate import PolicyEvaluator
    from localctx.backends.torch.loading import TorchOptions, load_model

    ref, _ = resolve_model(SessionRequest(model=model, backend="torch"))
    loaded = load_model(ref, TorchOptions.from_env())
    ev = PolicyEvaluator(loaded.model, loaded.tokenizer)
    _, _, _, ids = next(eval_tasks.passkey_cells(ev.tokenizer, NeedleTask(lengths=(length,), depths=(0.5,))))
    cache = ev._cache(KVPolicy.parse("fp16"), len(ids) + 8)
    tokens = torch.tensor(ids)
    marks, rows = set(checkpoints(len(ids), every)), {}
    with torch.no_grad():
        for start in range(0, len(ids), CHUNK):
            end = min(start + CHUNK, len(ids))
            logits = ev._forward(cache, tokens[start:end], all_logits=False)
            if end in marks:
                rows[end] = logits.reshape(-1)[-logits.shape[-1]:].double().numpy()
    return ids, rows


def top5(row: np.ndarray, piece) -> list[list]:
    return [[int(t), piece(int(t)), round(float(row[t]), 3)] for t in np.argsort(-row)[:5]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="a GGUF (default: Gemma 3 270M, as in quality_tables.py)")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--every", type=int, default=2048, help="a checkpoint every this many tokens (a multiple of 256)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    if args.every % CHUNK:
        ap.error(f"--every must be a multiple of {CHUNK}")
    model = args.model or gemma3_gguf()
    ids, ours = torch_rows(model, args.length, args.every)
    ids_ll, theirs = llamacpp_rows(model, args.length, args.every)
    if ids != ids_ll:
        sys.exit("the two backends tokenized the prompt differently; the logits would not be comparable")
    import llama_cpp

    vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    piece = lambda t: vocab.detokenize([t]).decode("utf-8", "replace")  # noqa: E731
    rows = []
    for pos in sorted(ours):
        a, b = ours[pos], theirs[pos]
        rows.append({"tokens": pos, "correlation": round(float(np.corrcoef(a, b)[0, 1]), 5),
                     "same_top5_set": set(np.argsort(-a)[:5].tolist()) == set(np.argsort(-b)[:5].tolist()),
                     "same_argmax": int(a.argmax()) == int(b.argmax())})
    last = max(ours)
    result = {"command": "python benchmarks/long_logits_vs_llamacpp.py " + " ".join(sys.argv[1:]),
              "model": Path(model).name, "prompt": f"passkey prompt, {len(ids)} tokens, key at depth 0.5",
              "policy": "fp16", "chunk": CHUNK, "checkpoints": rows,
              "last_position_top5": {"torch": top5(ours[last], piece), "llamacpp": top5(theirs[last], piece)}}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
