"""Which cached tokens a sinks + window (+ heavy hitters) policy drops. Pure numpy on token ids
(their index in the stream): the same decision for every store layout."""
from __future__ import annotations

import numpy as np

from localctx.kvcache.policy import KVPolicy


def victims(policy: KVPolicy, ids: np.ndarray, scores: np.ndarray, n_seen: int) -> np.ndarray:
    """Boolean mask over ``ids`` (kept tokens) of those to evict now. Sinks (the first
    ``sinks`` tokens of the stream) and the last ``window`` tokens stay; of the rest, the
    ``heavy`` with the largest accumulated attention stay (ties: the newer)."""
    out = np.zeros(len(ids), dtype=bool)
    cap = policy.capacity()
    if cap is None or len(ids) <= cap:
        return out
    middle = (ids >= policy.sinks) & (ids < n_seen - policy.window)
    candidates = np.flatnonzero(middle)
    keep = policy.heavy
    if keep:
        order = np.lexsort((ids[candidates], scores[candidates]))  # ascending score, then id
        candidates = candidates[order[:max(0, len(candidates) - keep)]]
    out[candidates] = True
    return out
