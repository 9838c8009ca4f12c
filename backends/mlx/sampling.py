"""Next-token choice from logits: greedy at temperature 0, else temperature + top-k + top-p; under a
structured-output grammar (``guide``: backends/generation/guided.Guide) only the tokens it allows are
candidates, and each chosen token moves it on."""
from __future__ import annotations

import numpy as np

from localctx.backends.base import GenerationParams


class Sampler:
    def __init__(self, params: GenerationParams, guide=None):
        self.params = params
        self.guide = guide
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.guide is None:
            return self._choose(logits)
        token = self._choose(np.where(self.guide.allowed(logits.shape[-1]), logits, -np.inf))
        self.guide.accept(token)
        return token

    def _choose(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature <= 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < len(z):
            cut = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z >= cut, z, -np.inf)
        probs = np.exp(z - np.max(z))
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs)
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, p.top_p) + 1)]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self.rng.choice(len(probs), p=probs))
