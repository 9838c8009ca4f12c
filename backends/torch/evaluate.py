"""Quality of a KV policy on the torch backend (docs/architecture.md "Measuring"):

- perplexity of a long text processed *through* the policy's cache, chunk by chunk, the way
  decoding sees it (tokens are quantized and evicted as they stream in; each chunk's
  next-token log-probs are scored against the cache as it stands);
- passkey retrieval over a grid of context lengths × depths, greedy, scored by exact match.

Each policy runs on a fresh cache of the same model; the caller puts the full-precision cache
beside it."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from localctx.kvcache.factory import CacheRequest, make_kv_cache
from localctx.kvcache.policy import KVPolicy

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
QUESTION = "\nWhat is the pass key? The pass key is"


def long_text() -> str:
    """About 465K characters of English shipped with Python (no download)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@dataclass(frozen=True)
class PerplexityTask:
    n_tokens: int = 8192  # tokens streamed through the cache
    chunk: int = 128  # tokens per forward (a decode step sees the cache as it stands)
    score_from: int = 0  # score predictions of tokens [score_from, n_tokens)
    segment: int = 0  # also report perplexity per segment of this many tokens (0 = off)


@dataclass(frozen=True)
class NeedleTask:
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    answer_tokens: int = 6
    seed: int = 0
    chunk: int = 128  # prefill chunk: the prompt streams through the cache as in perplexity


@dataclass
class PerplexityResult:
    ppl: float
    scored: int
    segments: list[tuple[int, int, float]] = field(default_factory=list)  # (from, to, ppl)
    kv_bytes: int = 0  # what the cache held at the end
    kv_tokens: int = 0
    seconds: float = 0.0


@dataclass
class NeedleResult:
    hits: int
    total: int
    grid: list[dict] = field(default_factory=list)  # {length, depth, key, answer, hit}
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.hits / self.total if self.total else 0.0


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

    # -- perplexity --------------------------------------------------------------------------
    def perplexity(self, policy: KVPolicy, ids: Sequence[int], task: PerplexityTask) -> PerplexityResult:
        started = time.perf_counter()
        tokens = torch.tensor(list(ids)[:task.n_tokens], dtype=torch.long)
        n = tokens.numel()
        cache = self._cache(policy, n)
        nll = torch.zeros(n, dtype=torch.float64)  # nll[i]: -log p(token i | tokens < i)
        for start in range(0, n - 1, task.chunk):
            end = min(start + task.chunk, n - 1)
            logits = self._forward(cache, tokens[start:end], all_logits=True)
            logp = torch.log_softmax(logits.float(), dim=-1)
            target = tokens[start + 1:end + 1]
            nll[start + 1:end + 1] = -logp.gather(1, target[:, None].to(logp.device))[:, 0].double().cpu()
        lo = max(1, task.score_from)
        segments = []
        if task.segment:
            for a in range(lo, n, task.segment):
                b = min(n, a + task.segment)
                segments.append((a, b, math.exp(float(nll[a:b].mean()))))
        return PerplexityResult(math.exp(float(nll[lo:n].mean())), n - lo, segments, cache.kv_bytes(0),
                                cache.kv_tokens(0), time.perf_counter() - started)

    # -- passkey retrieval ---------------------------------------------------------------------
    def passkey_prompt(self, length: int, depth: float, key: str) -> list[int]:
        """A prompt of about ``length`` tokens with the key sentence at ``depth`` (0 = start)."""
        enc = self.tokenizer.encode
        fixed = len(enc(INTRO + f"The pass key is {key}. Remember it. {key} is the pass key. " + QUESTION))
        per_filler = len(enc(FILLER * 8)) / 8
        n_fill = max(1, round((length - fixed) / per_filler))
        before = round(n_fill * depth)
        text = (INTRO + FILLER * before + f"The pass key is {key}. Remember it. {key} is the pass key. "
                + FILLER * (n_fill - before) + QUESTION)
        return enc(text)

    def needle(self, policy: KVPolicy, task: NeedleTask) -> NeedleResult:
        started = time.perf_counter()
        rng = random.Random(task.seed)
        grid, hits = [], 0
        for length in task.lengths:
            for depth in task.depths:
                key = str(rng.randint(10000, 99999))
                ids = self.passkey_prompt(length, depth, key)
                answer = self._greedy(policy, ids, task.answer_tokens, task.chunk)
                hit = answer.strip().startswith(key)
                hits += hit
                grid.append({"length": length, "tokens": len(ids), "depth": depth, "key": key,
                             "answer": answer, "hit": hit})
        return NeedleResult(hits, len(grid), grid, time.perf_counter() - started)

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


@dataclass
class PolicyReport:
    policy: str
    exact: bool
    perplexity: PerplexityResult | None = None
    needle: NeedleResult | None = None


def with_baseline(policies: Sequence[KVPolicy], baseline: bool = True) -> list[KVPolicy]:
    """The full-precision cache first (unless ``baseline`` is off), then each policy once, in order."""
    out = [KVPolicy()] if baseline else []
    for p in policies:
        if p not in out:
            out.append(p)
    return out


def text_tokens(tokenizer, n_tokens: int) -> list[int]:
    text = long_text()
    ids = tokenizer.encode(text[:n_tokens * 8])  # ~4 characters a token: plenty, and fast to encode
    if len(ids) < n_tokens:
        ids = tokenizer.encode(text)
    return ids[:n_tokens]


def evaluate(evaluator: PolicyEvaluator, policies: Sequence[KVPolicy], ppl: PerplexityTask | None,
             needle: NeedleTask | None, progress=None, baseline: bool = True) -> list[PolicyReport]:
    ids = text_tokens(evaluator.tokenizer, ppl.n_tokens) if ppl else []
    reports = []
    for policy in with_baseline(policies, baseline):
        report = PolicyReport(str(policy), policy.exact)
        if ppl:
            report.perplexity = evaluator.perplexity(policy, ids, ppl)
        if needle:
            report.needle = evaluator.needle(policy, needle)
        if progress:
            progress(report)
        reports.append(report)
    return reports
