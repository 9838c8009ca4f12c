"""Torch against llama.cpp along one long prompt: the next-token logits every ``--every`` tokens
of a passkey prompt (the one `localctx eval` builds for that length, key at ``--depth``), both
prefilled in 256-token chunks with the same KV policy (``--kv``, fp16 by default), then Pearson
correlation, the same top-5 set and the same argmax at each checkpoint, the top-5 (token, logit)
of both at the last position (the answer's first token), and the top two of both at each token
of torch's greedy answer, fed to both. It tells a model that is unsure at that length from a
backend that goes wrong past some position. Deterministic; no timing. Gemma 3 270M by default
(the figures of docs/quality.md):

    python benchmarks/quality/long_logits_vs_llamacpp.py --length 16384 --json docs/results/quality/quality-gemma3-long-logits-16k.json
    python benchmarks/quality/long_logits_vs_llamacpp.py --length 16384 --depth 0.9 --kv fp16+sink4+win4096 \
        --json docs/results/quality/quality-gemma3-long-logits-16k-win4096-d09.json
    python benchmarks/quality/long_logits_vs_llamacpp.py --length 16384 --depth 0.9 --grid-depths 0.1,0.9 \
        --kv fp16+sink4+win4096 --json docs/results/quality/quality-gemma3-long-logits-16k-win4096-edges-d09.json
    python benchmarks/quality/long_logits_vs_llamacpp.py --length 30720 --depth 0.9 --grid-depths 0.1,0.9 \
        --every 4096 --json docs/results/quality/quality-gemma3-long-logits-30k-edges-d09.json

With a window the two caches differ by design: llama.cpp's context shift evicts 256 tokens at a
time (it holds the sinks and the last 3,840–4,096 tokens), torch one token at a time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # bench_json
from bench_json import emit  # noqa: E402
from quality_tables import gemma3_gguf  # noqa: E402

from localctx.app.session_options import SessionRequest, resolve_model  # noqa: E402
from localctx.backends.evaluation import tasks  # noqa: E402
from localctx.backends.evaluation.tasks import NeedleTask  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

CHUNK = 256


def passkey_cell(tokenizer, cell: NeedleTask, depth: float) -> tuple[str, list[int]]:
    """The key and prompt ids of the cell at ``depth`` in ``localctx eval``'s grid ``cell`` (each
    cell's key is drawn in grid order, so the same depth in another grid holds another key)."""
    return next((key, ids) for _, d, key, ids in tasks.passkey_cells(tokenizer, cell) if d == depth)


def checkpoints(n: int, every: int) -> list[int]:
    return sorted({*range(every, n, every), n})


def llamacpp_rows(model: str, every: int, cell: NeedleTask, depth: float, policy: KVPolicy,
                  answer: list[int]) -> tuple[list[int], dict[int, np.ndarray], list[np.ndarray]]:
    """The prompt's tokens, the logits at each checkpoint, and the logits after each token of
    ``answer`` fed in turn (torch's greedy answer: the two backends are compared on the same input)."""
    from localctx.backends.llamacpp.evaluate import LlamaCppEvaluator

    ref, _ = resolve_model(SessionRequest(model=model, backend="llamacpp"))
    ev = LlamaCppEvaluator(ref, threads=1)
    _, ids = passkey_cell(ev.tokenizer, cell, depth)
    session = ev.session(policy, len(ids) + len(answer) + 8)
    marks, rows = set(checkpoints(len(ids), every)), {}
    for start in range(0, len(ids), CHUNK):  # chunks end at every checkpoint: every is a multiple of CHUNK
        end = min(start + CHUNK, len(ids))
        logits = ev._decode(session, ids[start:end], all_logits=False)
        if end in marks:
            rows[end] = logits[0].astype(np.float64)
    steps = [logits[0].astype(np.float64)]
    for tok in answer[:-1]:
        steps.append(ev._decode(session, [tok], all_logits=False)[0].astype(np.float64))
    return ids, rows, steps


def torch_rows(model: str, every: int, cell: NeedleTask, depth: float, policy: KVPolicy,
               n_answer: int) -> tuple[str, list[int], dict[int, np.ndarray], list[np.ndarray], list[int]]:
    """The key, the prompt's tokens, the logits at each checkpoint, and the logits and tokens of a
    greedy answer of ``n_answer`` tokens."""
    import torch

    from localctx.backends.torch.evaluate import PolicyEvaluator
    from localctx.backends.torch.loading import TorchOptions, load_model

    ref, _ = resolve_model(SessionRequest(model=model, backend="torch"))
    loaded = load_model(ref, TorchOptions.from_env())
    ev = PolicyEvaluator(loaded.model, loaded.tokenizer)
    key, ids = passkey_cell(ev.tokenizer, cell, depth)
    cache = ev._cache(policy, len(ids) + n_answer + 8)
    tokens = torch.tensor(ids)
    last_row = lambda logits: logits.reshape(-1)[-logits.shape[-1]:].double().numpy()  # noqa: E731
    marks, rows, steps, answer = set(checkpoints(len(ids), every)), {}, [], []
    with torch.no_grad():
        for start in range(0, len(ids), CHUNK):
            end = min(start + CHUNK, len(ids))
            logits = ev._forward(cache, tokens[start:end], all_logits=False)
            if end in marks:
                rows[end] = last_row(logits)
        for _ in range(n_answer):
            steps.append(last_row(logits))
            answer.append(int(steps[-1].argmax()))
            logits = ev._forward(cache, torch.tensor([answer[-1]]), all_logits=False)
    return key, ids, rows, steps, answer


def top5(row: np.ndarray, piece) -> list[list]:
    return [[int(t), piece(int(t)), round(float(row[t]), 3)] for t in np.argsort(-row)[:5]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="a GGUF (default: Gemma 3 270M, as in quality_tables.py)")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--depth", type=float, default=0.5, help="where the key sits in the prompt (0-1)")
    ap.add_argument("--grid-depths", default=None, metavar="D,D,...",
                    help="the --needle-depths of the `localctx eval` run whose cell at --depth to rebuild "
                         "(its key depends on the grid; default: --depth alone)")
    ap.add_argument("--kv", default="fp16", help="the KV policy both backends run (e.g. fp16+sink4+win4096)")
    ap.add_argument("--every", type=int, default=2048, help="a checkpoint every this many tokens (a multiple of 256)")
    ap.add_argument("--answer", type=int, default=8, help="answer tokens compared after the prompt: torch's "
                    "greedy answer, fed to llama.cpp too (teacher-forced)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    if args.every % CHUNK:
        ap.error(f"--every must be a multiple of {CHUNK}")
    if not 0.0 <= args.depth <= 1.0:
        ap.error("--depth must be between 0 and 1")
    if args.answer < 1:
        ap.error("--answer must be at least 1")
    try:
        policy = KVPolicy.parse(args.kv)
    except ValueError as e:
        ap.error(f"--kv: {e}")
    model = args.model or gemma3_gguf()
    try:
        depths = tuple(float(d) for d in args.grid_depths.split(",")) if args.grid_depths else (args.depth,)
    except ValueError:
        ap.error("--grid-depths takes numbers separated by commas, e.g. 0.1,0.9")
    if args.depth not in depths:
        ap.error(f"--depth {args.depth} is not one of --grid-depths {args.grid_depths}")
    cell = NeedleTask(lengths=(args.length,), depths=depths)
    key, ids, ours, our_steps, answer = torch_rows(model, args.every, cell, args.depth, policy, args.answer)
    ids_ll, theirs, their_steps = llamacpp_rows(model, args.every, cell, args.depth, policy, answer)
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
    top2 = lambda row: [[piece(int(t)), round(float(row[t]), 3)] for t in np.argsort(-row)[:2]]  # noqa: E731
    steps = [{"step": i, "torch_top2": top2(a), "llamacpp_top2": top2(b),
              "same_argmax": int(a.argmax()) == int(b.argmax())}
             for i, (a, b) in enumerate(zip(our_steps, their_steps))]
    result = {"command": "python benchmarks/quality/long_logits_vs_llamacpp.py " + " ".join(sys.argv[1:]),
              "model": Path(model).name,
              "prompt": f"passkey prompt, {len(ids)} tokens, key {key} at depth {args.depth}",
              "policy": str(policy), "chunk": CHUNK, "checkpoints": rows,
              "last_position_top5": {"torch": top5(ours[last], piece), "llamacpp": top5(theirs[last], piece)},
              "answer": {"torch_greedy": vocab.detokenize(answer).decode("utf-8", "replace"),
                         "note": "llama.cpp is fed torch's answer token by token; each step's top two on both",
                         "steps": steps}}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
