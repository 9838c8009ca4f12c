"""Quality of a KV policy on the torch backend (docs/architecture.md "Measuring"):

- perplexity of a long text processed *through* the policy's cache, chunk by chunk, the way
  decoding sees it (tokens are quantized and evicted as they stream in; each chunk's
  next-token log-probs are scored against the cache as it stands);
- passkey retrieval over a grid of context lengths × depths, greedy, scored by exact match;
- the long-context tasks of backends/evaluation/long_tasks.py, greedy, scored by exact match.

Each policy runs on a fresh cache of the same model; the caller puts the full-precision cache
beside it."""
from __future__ import annotations

import time
from typing import Sequence

import torch

from localctx.backends.evaluation import divergence, long_tasks, tasks
from localctx.backends.evaluation.divergence import Divergence, DivergenceMeter, compare
from localctx.backends.evaluation.long_tasks import TaskSuite
from localctx.backends.evaluation.tasks import (FILLER, INTRO, QUESTION, NeedleResult, NeedleTask,  # noqa: F401
                                          PerplexityResult, PerplexityTask, PolicyReport, long_text, text_tokens,
                                          with_baseline)
from localctx.kvcache.factory import CacheRequest, make_kv_cache
from localctx.kvcache.policy import KVPolicy


class PolicyEvaluator:
    """Runs the tasks for one loaded model (``model``: a torch model page's model; ``tokenizer``: its
    TextTokenizer)."""

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer

    def _cache(self, policy: KVPolicy, capacity: int):
        c = self.model.config
        req = CacheRequest(c.n_layers, c.n_kv_heads, c.head_dim, capacity_tokens=capacity,
                           dtype=self.model.dtype, device=self.model.device,
                           layer_windows=self.model.layer_windows())
        cache = make_kv_cache(policy, req, self.model.make_rope())
        cache.add_sequence(0)
        return cache

    def _forward(self, cache, ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
        cache.begin_step([0], ids.numel())
        try:
            return self.model.forward(ids[None].to(self.model.device), cache, all_logits=all_logits)[0]
        finally:
            cache.end_step()

    # -- perplexity and KL divergence, every policy in lockstep -----------------------------------
    def perplexity(self, policy: KVPolicy, ids: Sequence[int], task: PerplexityTask) -> PerplexityResult:
        return self.lockstep([policy], ids, task, reference=False)[0][0]

    def lockstep(self, policies: Sequence[KVPolicy], ids: Sequence[int], task: PerplexityTask,
                 reference: bool = True, on_chunk=None) -> list[tuple[PerplexityResult, Divergence | None]]:
        """The text streamed through a fresh cache per policy a chunk at a time, each scored against
        its cache as it stands; with ``reference``, ``policies[0]`` is the full-precision cache and
        every other policy's next-token distribution is compared with its on the same positions
        (backends/evaluation/divergence.py). ``on_chunk(done, total)`` after each chunk."""
        started = time.perf_counter()
        tokens = torch.tensor(list(ids)[:task.n_tokens], dtype=torch.long)
        n = tokens.numel()
        caches = [self._cache(policy, n) for policy in policies]
        nll = [[0.0] * n for _ in policies]  # nll[j][i]: -log p(token i | tokens < i) through cache j
        meters = [DivergenceMeter() for _ in policies[1:]]
        first = max(1, task.score_from)
        for start in range(0, n - 1, task.chunk):
            end = min(start + task.chunk, n - 1)
            outs = [self._forward(cache, tokens[start:end], all_logits=True).float().cpu().numpy()
                    for cache in caches]
            targets = tokens[start + 1:end + 1].tolist()
            if reference:
                rows = compare(outs[0], outs[1:], targets, meters, first=first - 1 - start)
            else:
                rows = [divergence.compare(out, [], targets, [])[0] for out in outs]
            for j, row in enumerate(rows):
                nll[j][start + 1:end + 1] = row.tolist()
            if on_chunk:
                on_chunk(end, n - 1)
        seconds = time.perf_counter() - started
        return [(tasks.perplexity_result(nll[j], task, cache.kv_bytes(0), cache.kv_tokens(0), seconds),
                 meters[j - 1].result() if reference and j else None) for j, cache in enumerate(caches)]

    # -- passkey retrieval ---------------------------------------------------------------------
    def passkey_prompt(self, length: int, depth: float, key: str) -> list[int]:
        """A prompt of about ``length`` tokens with the key sentence at ``depth`` (0 = start)."""
        return tasks.passkey_prompt(self.tokenizer, length, depth, key)

    def needle(self, policy: KVPolicy, task: NeedleTask) -> NeedleResult:
        return tasks.needle_grid(tasks.passkey_cells(self.tokenizer, task),
                                      lambda ids: self._greedy(policy, ids, task.answer_tokens, task.chunk))

    def _greedy(self, policy: KVPolicy, ids: list[int], n_new: int, chunk: int) -> str:
        cache = self._cache(policy, len(ids) + n_new)
        tokens = torch.tensor(ids, dtype=torch.long)
        for start in range(0, len(ids), chunk):
            logits = self._forward(cache, tokens[start:start + chunk], all_logits=False)
        out = []
        for _ in range(n_new):
            tok = int(logits.argmax())
            out.append(tok)
            logits = self._forward(cache, torch.tensor([tok]), all_logits=False)
        return self.tokenizer.decode(out)


def evaluate(evaluator: PolicyEvaluator, policies: Sequence[KVPolicy], ppl: PerplexityTask | None,
             needle: NeedleTask | None, progress=None, baseline: bool = True, on_chunk=None,
             suite: TaskSuite | None = None) -> list[PolicyReport]:
    """Each policy's report (the full-precision cache first with ``baseline``): perplexity and, beside
    the full-precision cache, KL divergence with every policy in lockstep; then the passkey grid and the
    long-context tasks (``suite``)."""
    ordered = with_baseline(policies, baseline)
    reports = [PolicyReport(str(policy), policy.exact) for policy in ordered]
    if ppl:
        ids = text_tokens(evaluator.tokenizer, ppl.n_tokens)
        results = evaluator.lockstep(ordered, ids, ppl, reference=baseline, on_chunk=on_chunk)
        for report, (result, div) in zip(reports, results):
            report.perplexity, report.divergence = result, div
    samples = list(long_tasks.samples(evaluator.tokenizer, suite)) if suite else []
    for policy, report in zip(ordered, reports):
        if needle:
            report.needle = evaluator.needle(policy, needle)
        if suite:
            report.long_tasks = long_tasks.run(samples, lambda p, n: evaluator._greedy(policy, p, n, suite.chunk))
        if progress:
            progress(report)
    return reports
