"""Prompt lookup (``--speculate ngram``) on the MLX engine: the verifier the speculative loop
(backends/generation/speculation.py) drives over the session's one sequence, on a page's cache or
an mlx-lm model's policy cache alike. A verify step appends at most the tokens after which the cache
is still the cache before it plus those tokens (nothing quantized or evicted on the way:
``chunk_view.substep_length``), so a rejected draft is cut back exactly (``cache.truncate``); mlx-lm's
own caches (sliding or recurrent layers) cannot be cut back, so there each step is one token."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from localctx.backends.generation.speculation import MAX_DRAFT
from localctx.backends.mlx.lm_cache import NativeCache
from localctx.kvcache import chunk_view


class MLXVerifier:
    def __init__(self, session, context_limit: int | None):
        self.session = session
        self.context_limit = context_limit  # None: a windowed cache streams on

    def room(self) -> int:
        cache = self.session.cache
        if isinstance(cache, NativeCache):
            return 1
        room = MAX_DRAFT + 1
        for layer in cache.layers:  # a page's sliding layers run policies of their own
            r = chunk_view.substep_length(layer.policy, layer.n_seen, MAX_DRAFT + 2) - 1
            if layer.model_window is not None and layer.n_seen + r + 1 > layer.model_window:
                r = 0  # the layer evicts as it appends
            room = min(room, r)
        if self.context_limit is not None:
            room = min(room, self.context_limit - len(self.session.fed))
        return max(1, room)

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        return self.session.feed(list(tokens), all_logits=True).reshape(len(tokens), -1)

    def rollback(self, n: int) -> None:
        if not n:
            return
        s = self.session
        keep = len(s.fed) - n
        if not s.cache.truncate(keep):
            raise RuntimeError(f"the MLX cache cannot roll back to {keep} tokens; room() allowed a step it could not undo")
        del s.fed[keep:]
        s.last_logits = None
