"""Quality of a KV policy on the MLX backend: the tasks of backends/evaluation/ run through an MLX
session's policy cache (backends/mlx/session.py, backends/mlx/policy_cache.py), the weights loaded
once and a fresh session (cache) per policy:

- perplexity, and KL divergence from the full-precision cache, with every policy in lockstep
  (backends/evaluation/divergence.py): the text streams ``chunk`` tokens per forward through each
  cache, and each chunk's next-token distributions are compared on the same positions;
- passkey and the long-context tasks (backends/evaluation/long_tasks.py): the prompt streams in
  ``chunk``-token forwards, then greedy decoding, exact match."""
from __future__ import annotations

import json
import time
from typing import Sequence

import numpy as np

from localctx.backends.evaluation import long_tasks
from localctx.backends.evaluation.divergence import Divergence, DivergenceMeter, compare
from localctx.backends.evaluation.long_tasks import TaskSuite
from localctx.backends.evaluation.tasks import (NeedleResult, NeedleTask, PerplexityResult, PerplexityTask,
                                                PolicyReport, needle_grid, passkey_cells, perplexity_result,
                                                text_tokens, with_baseline)
from localctx.backends.models.ref import ModelRef
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


class MLXEvaluator:
    """Loads one GGUF or safetensors folder once; a fresh session (cache) per policy.

    ``graph``: "page" runs every policy on localctx's own page (llama.py, gemma3.py), as ``localctx
    eval`` does; "auto" runs each on the graph ``localctx run`` takes for it (``zoo.graph_for``: mlx-lm's
    model with localctx's policy cache where it can), loading mlx-lm's model once when first needed."""

    def __init__(self, ref: ModelRef, chunk: int = 128, graph: str = "page"):
        from localctx.backends.mlx.backend import MLXBackend, held_in_compute_dtype
        from localctx.backends.mlx.tokenizer import folder_tokenizer, gguf_tokenizer
        from localctx.backends.models.spec_reader import read_gguf, read_spec

        if ref.kind not in ("gguf", "hf"):
            raise UserError(f"--backend mlx evaluates GGUF files and safetensors folders, not {ref.kind!r} models")
        self.ref, self.spec, self.chunk, self.graph = ref, held_in_compute_dtype(read_spec(ref)), chunk, graph
        self.backend = MLXBackend()
        self.backend.check_model(self.spec)
        self.models: dict[str, object] = {}  # graph → the model, loaded when first asked for
        if ref.kind == "gguf":
            self.tokenizer = gguf_tokenizer(ref.path, read_gguf(ref.path))
        else:
            self.tokenizer = folder_tokenizer(ref.path, json.loads((ref.path / "config.json").read_text()))

    def refuse(self, policy: KVPolicy) -> None:
        reasons = self.backend.refusals(policy, self.spec)
        if reasons:
            raise UserError(f"mlx cannot run --kv {policy}: {reasons[0]}")

    def graph_of(self, policy: KVPolicy) -> str:
        from localctx.backends.mlx import zoo

        return zoo.graph_for(self.spec, policy, self.graph)

    def _model(self, graph: str):
        if graph not in self.models:
            from localctx.backends.mlx import loading, zoo

            if graph == "page":
                load = loading.load_gguf if self.ref.kind == "gguf" else loading.load_folder
                self.models[graph] = load(self.ref.path)[0]
            else:
                load = zoo.load_gguf if self.ref.kind == "gguf" else zoo.load_folder
                self.models[graph] = load(self.ref.path, self.spec.architecture)
        return self.models[graph]

    def session(self, policy: KVPolicy, context: int, chunk: int | None = None, graph: str | None = None):
        """A fresh session holding ``context`` tokens, prefilling ``chunk`` (default: the evaluator's) at a
        time, on ``graph`` (default: ``graph_of(policy)``)."""
        from localctx.backends.mlx.session import MLXSession, SessionOptions

        self.refuse(policy)
        model = self._model(graph or self.graph_of(policy))
        return MLXSession(model, self.tokenizer, self.spec, Plan.fixed("mlx", self.spec, policy, context),
                          SessionOptions(prefill_chunk=chunk or self.chunk))

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.tokenizer.token_bytes(t) for t in ids).decode("utf-8", errors="replace")

    # -- perplexity and KL divergence, every policy in lockstep -----------------------------------
    def perplexity(self, policy: KVPolicy, ids: Sequence[int], task: PerplexityTask) -> PerplexityResult:
        session = self.session(policy, len(list(ids)[:task.n_tokens]), task.chunk)
        return self.lockstep([session], ids, task, reference=False)[0][0]

    def lockstep(self, sessions: list, ids: Sequence[int], task: PerplexityTask, reference: bool = True,
                 on_chunk=None) -> list[tuple[PerplexityResult, Divergence | None]]:
        """As the llama.cpp and torch evaluators: ``sessions[0]`` the reference with ``reference``."""
        started = time.perf_counter()
        tokens = list(ids)[:task.n_tokens]
        n = len(tokens)
        for session in sessions:
            session.reset()
        nll = [[0.0] * n for _ in sessions]
        meters = [DivergenceMeter() for _ in sessions[1:]]
        first = max(1, task.score_from)
        for start in range(0, n - 1, task.chunk):
            end = min(start + task.chunk, n - 1)
            outs = [session.feed(tokens[start:end], all_logits=True) for session in sessions]
            targets = tokens[start + 1:end + 1]
            if reference:
                rows = compare(outs[0], outs[1:], targets, meters, first=first - 1 - start)
            else:
                rows = [compare(out, [], targets, [])[0] for out in outs]
            for j, row in enumerate(rows):
                nll[j][start + 1:end + 1] = row.tolist()
            if on_chunk:
                on_chunk(end, n - 1)
        seconds = time.perf_counter() - started
        return [(perplexity_result(nll[j], task, s.cache.nbytes(), s.cache.n_kept, seconds),
                 meters[j - 1].result() if reference and j else None) for j, s in enumerate(sessions)]

    # -- greedy answers: passkey and the long-context tasks ---------------------------------------
    def _answer(self, session, ids: list[int], n_new: int) -> str:
        session.reset()
        logits = session.feed(ids)
        out = []
        for _ in range(n_new):
            rows = np.asarray(logits)
            out.append(int(rows.reshape(-1, rows.shape[-1])[-1].argmax()))
            logits = session.feed([out[-1]])
        return self.decode(out)

    def greedy(self, policy: KVPolicy, ids: list[int], n_new: int, chunk: int) -> str:
        """``n_new`` greedy tokens after ``ids`` through a fresh cache of ``policy``."""
        return self._answer(self.session(policy, len(ids) + n_new, chunk), ids, n_new)

    def needle(self, session, cells, task: NeedleTask) -> NeedleResult:
        return needle_grid(cells, lambda ids: self._answer(session, ids, task.answer_tokens))


def evaluate(evaluator: MLXEvaluator, policies: Sequence[KVPolicy], ppl: PerplexityTask | None,
             needle: NeedleTask | None, progress=None, baseline: bool = True, on_chunk=None,
             suite: TaskSuite | None = None) -> list[PolicyReport]:
    """Each policy's report (the full-precision cache first with ``baseline``): perplexity and, beside
    the full-precision cache, KL divergence with every policy in lockstep; then the passkey grid and the
    long-context tasks (``suite``), one policy at a time."""
    ordered = with_baseline(policies, baseline)
    for policy in ordered:  # refuse before anything runs
        evaluator.refuse(policy)
    reports = [PolicyReport(str(policy), policy.exact) for policy in ordered]
    if ppl:
        ids = text_tokens(evaluator.tokenizer, ppl.n_tokens)
        graphs = [evaluator.graph_of(policy) for policy in ordered]
        if baseline and len(ordered) > 1:  # the reference runs on the graph of the policies it is compared with
            graphs[0] = graphs[1]
        sessions = [evaluator.session(policy, len(ids), ppl.chunk, graph) for policy, graph in zip(ordered, graphs)]
        results = evaluator.lockstep(sessions, ids, ppl, reference=baseline, on_chunk=on_chunk)
        for report, (result, div) in zip(reports, results):
            report.perplexity, report.divergence = result, div
    cells = list(passkey_cells(evaluator.tokenizer, needle)) if needle else []
    samples = list(long_tasks.samples(evaluator.tokenizer, suite)) if suite else []
    for policy, report in zip(ordered, reports):
        if needle:
            session = evaluator.session(policy, max(len(c[3]) for c in cells) + needle.answer_tokens,
                                        needle.chunk)
            report.needle = evaluator.needle(session, cells, needle)
        if suite:
            report.long_tasks = long_tasks.run(samples, lambda p, n: evaluator.greedy(policy, p, n, suite.chunk))
        if progress:
            progress(report)
    return reports
