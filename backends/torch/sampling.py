"""Next-token choice from logits: greedy, or temperature + top-k + top-p with a seeded generator;
under a structured-output grammar (``guide``: backends/generation/guided.Guide) only the tokens it
allows are candidates, and each chosen token moves it on."""
from __future__ import annotations

import torch

from localctx.backends.base import GenerationParams


class Sampler:
    def __init__(self, params: GenerationParams, guide=None):
        self.params = params
        self.guide = guide
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [vocab] (float32)."""
        if self.guide is None:
            return self._choose(logits)
        allowed = torch.from_numpy(self.guide.allowed(logits.numel())).to(logits.device)
        token = self._choose(logits.float().masked_fill(~allowed, float("-inf")))
        self.guide.accept(token)
        return token

    def _choose(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(before >= p.top_p, 0.0)  # keep the nucleus, at least one
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
