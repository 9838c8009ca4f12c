"""Quality of a KV policy on the MLX backend: the tasks of backends/evaluation/ run through an MLX
session's policy cache (backends/mlx/session.py, backends/mlx/policy_cache.py), the weights loaded
once and a fresh cache per policy:

- perplexity: the text streams ``chunk`` tokens per forward with the logits of every position,
  each next-token log-prob scored against the cache as it stands;
- passkey and the long-context tasks: the prompt streams in ``chunk``-token forwards, then greedy
  decoding, exact match."""
from __future__ import annotations

import time
from typing import Sequence

import mlx.core as mx
import numpy as np

from localctx.backends.evaluation import long_tasks
from localctx.backends.evaluation.long_tasks import TaskSuite
from localctx.backends.evaluation.tasks import (NeedleResult, NeedleTask, PerplexityResult, PerplexityTask, PolicyReport,
                                                needle_grid, passkey_cells, perplexity_result, text_tokens,
                                                with_baseline)
from localctx.backends.models.ref import ModelRef
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


class MLXEvaluator:
    """Runs the tasks for one model file (GGUF or safetensors folder)."""

    def __init__(self, ref: ModelRef):
        from localctx.backends.mlx.loading import load_folder, load_gguf
        from localctx.backends.mlx.tokenizer import folder_tokenizer, gguf_tokenizer
        from localctx.backends.models.spec_reader import read_spec

        if ref.kind not in ("gguf", "hf"):
            raise UserError(f"--backend mlx runs GGUF files and safetensors folders, not {ref.kind!r} models")
        self.spec = read_spec(ref)
        if ref.kind == "gguf":
            self.loaded, meta = load_gguf(ref.path)
            self.tokenizer = gguf_tokenizer(ref.path, meta)
        else:
            self.loaded, cfg = load_folder(ref.path)
            self.tokenizer = folder_tokenizer(ref.path, cfg)

    def refuse(self, policy: KVPolicy) -> None:
        from localctx.backends.mlx.backend import MLXBackend

        reasons = MLXBackend().refusals(policy, self.spec)
        if reasons:
            raise UserError(f"mlx cannot run --kv {policy}: {reasons[0]}")

    def session(self, policy: KVPolicy, context: int, chunk: int):
        from localctx.backends.mlx.session import MLXSession, SessionOptions

        return MLXSession(self.loaded, self.tokenizer, self.spec, Plan.fixed("mlx", self.spec, policy, context),
                          SessionOptions(prefill_chunk=chunk))

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.tokenizer.token_bytes(t) for t in ids).decode("utf-8", errors="replace")

    def perplexity(self, policy: KVPolicy, ids: Sequence[int], task: PerplexityTask) -> PerplexityResult:
        started = time.perf_counter()
        tokens = list(ids)[:task.n_tokens]
        n = len(tokens)
        session = self.session(policy, n, task.chunk)
        nll = [0.0] * n
        for start in range(0, n - 1, task.chunk):
            end = min(start + task.chunk, n - 1)
            logits = mx.array(session.feed(tokens[start:end], all_logits=True)).astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            target = mx.array(tokens[start + 1:end + 1])
            picked = mx.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
            nll[start + 1:end + 1] = (-np.array(picked, dtype=np.float64)).tolist()
        held, in_cache = session.cache.nbytes(), session.cache.n_kept
        return perplexity_result(nll, task, held, in_cache, time.perf_counter() - started)

    def greedy(self, policy: KVPolicy, ids: list[int], n_new: int, chunk: int) -> str:
        session = self.session(policy, len(ids) + n_new, chunk)
        logits = session.feed(ids)
        out = []
        for _ in range(n_new):
            tok = int(np.asarray(logits).reshape(-1).argmax())
            out.append(tok)
            logits = session.feed([tok])
        return self.decode(out)

    def needle(self, policy: KVPolicy, cells, task: NeedleTask) -> NeedleResult:
        return needle_grid(cells, lambda ids: self.greedy(policy, ids, task.answer_tokens, task.chunk))


def evaluate(evaluator: MLXEvaluator, policies: Sequence[KVPolicy], ppl: PerplexityTask | None,
             needle: NeedleTask | None, progress=None, baseline: bool = True,
             suite: TaskSuite | None = None) -> list[PolicyReport]:
    ordered = with_baseline(policies, baseline)
    for policy in ordered:  # refuse before anything runs
        evaluator.refuse(policy)
    ids = text_tokens(evaluator.tokenizer, ppl.n_tokens) if ppl else []
    cells = list(passkey_cells(evaluator.tokenizer, needle)) if needle else []
    samples = list(long_tasks.samples(evaluator.tokenizer, suite)) if suite else []
    reports = []
    for policy in ordered:
        report = PolicyReport(str(policy), policy.exact)
        if ppl:
            report.perplexity = evaluator.perplexity(policy, ids, ppl)
        if needle:
            report.needle = evaluator.needle(policy, cells, needle)
        if suite:
            report.long_tasks = long_tasks.run(samples, lambda p, n: evaluator.greedy(policy, p, n, suite.chunk))
        if progress:
            progress(report)
        reports.append(report)
    return reports

