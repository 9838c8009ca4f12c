"""Speculative verify on the torch engine: one sequence of the paged or policy cache."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from localctx.backends.generation.speculation import MAX_DRAFT
from localctx.backends.torch.engine import Engine


class TorchVerifier:
    """``backends.speculative.Verifier`` over one cache sequence; ``history`` (the session's list
    of cached tokens) is kept in step with the cache."""

    def __init__(self, engine: Engine, seq_id: int, history: list[int], context_limit: int | None):
        self.engine = engine
        self.seq_id = seq_id
        self.history = history
        self.context_limit = context_limit  # None: a windowed cache streams on

    def room(self) -> int:
        room = self.engine.cache.append_room(self.seq_id, limit=MAX_DRAFT + 1)
        if self.context_limit is not None:
            room = min(room, self.context_limit - len(self.history))
        return max(1, room)

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        if len(tokens) == 1:  # the plain decode step, bit for bit
            logits = self.engine.decode([self.seq_id], tokens)
        else:
            logits = self.engine.prefill(self.seq_id, tokens, all_logits=True)
        self.history.extend(tokens)
        return logits.float().cpu().numpy().reshape(len(tokens), -1)

    def rollback(self, n: int) -> None:
        if n:
            self.engine.cache.drop_newest(self.seq_id, n)
            del self.history[-n:]
