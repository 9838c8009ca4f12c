"""The KV policy semantics written plainly, as a drop-in for ``LayerCache``: every token kept
dense (float32, values rounded to the cache's full-precision dtype), a kept flag per token,
attention over the kept tokens at their ranks (float32, the fast path's arithmetic),
quantization simulated by quantizing then dequantizing contiguous groups of ``group_size``
tokens in stream order as they age past the residual. No slots, no holes, no packed codes:
what the fast cache must equal (exactly for eviction-only and quantize-only policies; for
quantized + evicting policies the fast cache regroups tokens, so it matches within
quantization noise). Used by tests and as the quality baseline of ``localctx eval``."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from localctx.backends.mlx.cache import CacheShape
from localctx.kernels_metal.quant import (QuantFormat, dequantize_keys, dequantize_values, quantize_keys,
                                          quantize_values)
from localctx.kernels_metal.rope import rope_at
from localctx.kvcache.policy import KVPolicy


class ReferenceLayerCache:
    def __init__(self, policy: KVPolicy, shape: CacheShape, inv_freq: mx.array):
        self.policy, self.shape, self.inv_freq = policy, shape, inv_freq
        self.fmt = QuantFormat(policy.bits if policy.quantized else 8, policy.group_size)
        self.keys = np.zeros((shape.n_kv_heads, 0, shape.head_dim), np.float32)  # every token ever seen
        self.values = np.zeros_like(self.keys)
        self.kept = np.zeros(0, dtype=bool)
        self.score = np.zeros(0)
        self.quantized = np.zeros(0, dtype=bool)  # holds quantize→dequantize values

    @property
    def n_seen(self) -> int:
        return len(self.kept)

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())

    def kept_ids(self) -> np.ndarray:
        return np.flatnonzero(self.kept)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        length = q.shape[1]
        rnd = lambda a: np.array(a.astype(self.shape.full_dtype).astype(mx.float32))  # noqa: E731
        self.keys = np.concatenate([self.keys, rnd(k)], axis=1)
        self.values = np.concatenate([self.values, rnd(v)], axis=1)
        self.kept = np.concatenate([self.kept, np.ones(length, dtype=bool)])
        self.score = np.concatenate([self.score, np.zeros(length)])
        self.quantized = np.concatenate([self.quantized, np.zeros(length, dtype=bool)])
        ids = self.kept_ids()
        positions = np.arange(len(ids))  # rank among the kept tokens
        keys = rope_at(mx.array(self.keys[:, ids]), mx.array(positions), self.inv_freq, self.shape.traditional_rope)
        q_pos = positions[-length:]
        qr = rope_at(q, mx.array(q_pos), self.inv_freq, self.shape.traditional_rope)
        n_kv, rep = self.shape.n_kv_heads, q.shape[0] // self.shape.n_kv_heads
        qg = qr.astype(mx.float32).reshape(n_kv, rep, length, -1)
        s = (qg @ keys[:, None].swapaxes(-1, -2)) * scale  # float32, as the fast path computes
        s = mx.where(mx.array(positions[None, :] <= q_pos[:, None]), s, -mx.inf)
        w = mx.softmax(s, axis=-1, precise=True)
        out = w @ mx.array(self.values[:, ids])[:, None]
        self.score[ids] += np.array(mx.sum(w, axis=(0, 1, 2)), dtype=np.float64)
        self._evict()
        if self.policy.quantized:
            self._quantize_aged()
        return out.reshape(q.shape[0], length, -1)

    def _evict(self) -> None:
        p = self.policy
        if p.window is None or self.n_kept <= p.capacity():
            return
        ids = self.kept_ids()
        middle = ids[(ids >= p.sinks) & (ids < self.n_seen - p.window)]
        ranked = sorted(middle, key=lambda i: (self.score[i], i), reverse=True)
        for i in ranked[p.heavy:]:
            self.kept[i] = False

    def _quantize_aged(self) -> None:
        """Whole groups of the oldest full-precision kept tokens, once past the residual."""
        g = self.fmt.group_size
        full = np.flatnonzero(self.kept & ~self.quantized)
        while len(full) - self.policy.residual >= g:
            group, full = full[:g], full[g:]
            k, v = mx.array(self.keys[:, group]), mx.array(self.values[:, group])
            self.keys[:, group] = np.array(dequantize_keys(*quantize_keys(k, self.fmt), self.fmt))
            self.values[:, group] = np.array(dequantize_values(*quantize_values(v, self.fmt), self.fmt))
            self.quantized[group] = True


class ReferenceModelCache:
    """Per-layer reference caches with ModelCache's read-outs (no byte count: it holds no codes)."""

    def __init__(self, policy: KVPolicy, n_layers: int, shape: CacheShape, inv_freq: mx.array):
        self.policy = policy
        self.layers = [ReferenceLayerCache(policy, shape, inv_freq) for _ in range(n_layers)]

    def arrays(self) -> list[mx.array]:
        return []
