"""The KV policy rules of kvcache/eviction.py written plainly, as a drop-in for ``LayerCache``:
every token kept dense (float32, rounded to the cache's full-precision dtype) with a kept flag
and a quantized flag; quantization simulated by quantizing then dequantizing a group in place;
attention over the kept tokens at their ranks, float32 as the fast path computes it; a chunk
decoded one token at a time (what a chunk must attend as). No stores, slots or packed codes:
what ``LayerCache`` must equal. Used by the tests."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from localctx.backends.mlx.policy_cache import CacheShape
from localctx.kernels_metal.quant import (QuantFormat, dequantize_keys, dequantize_values, quantize_keys,
                                          quantize_values)
from localctx.kernels_metal.rope import rope_at
from localctx.kvcache import eviction
from localctx.kvcache.policy import KVPolicy, uniform_bits


class ReferenceLayerCache:
    def __init__(self, policy: KVPolicy, shape: CacheShape, inv_freq: mx.array):
        self.policy, self.shape, self.inv_freq = policy, shape, inv_freq
        self.fmt = QuantFormat(uniform_bits(policy) if policy.quantized else 8, policy.group_size)
        self.keys = np.zeros((shape.n_kv_heads, 0, shape.head_dim), np.float32)  # every token ever seen
        self.values = np.zeros_like(self.keys)
        self.kept = np.zeros(0, dtype=bool)
        self.mass = np.zeros(0, dtype=np.float64)
        self.quantized = np.zeros(0, dtype=bool)

    @property
    def n_seen(self) -> int:
        return len(self.kept)

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())

    def kept_ids(self) -> np.ndarray:
        return np.flatnonzero(self.kept)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """A chunk attends as decoding its tokens one at a time: it is decoded one at a time."""
        if q.shape[1] > 1:
            return mx.concatenate([self.attend(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], scale)
                                   for t in range(q.shape[1])], axis=1)
        length = 1
        rnd = lambda a: np.array(a.astype(self.shape.full_dtype).astype(mx.float32))  # noqa: E731
        self.keys = np.concatenate([self.keys, rnd(k)], axis=1)
        self.values = np.concatenate([self.values, rnd(v)], axis=1)
        self.kept = np.concatenate([self.kept, np.ones(length, dtype=bool)])
        self.mass = np.concatenate([self.mass, np.zeros(length)])
        self.quantized = np.concatenate([self.quantized, np.zeros(length, dtype=bool)])
        ids = self.kept_ids()
        positions = np.arange(len(ids))  # rank among the kept tokens
        keys = rope_at(mx.array(self.keys[:, ids]), mx.array(positions), self.inv_freq, self.shape.traditional_rope)
        q_pos = positions[-length:]
        qr = rope_at(q, mx.array(q_pos), self.inv_freq, self.shape.traditional_rope)
        n_kv, rep = self.shape.n_kv_heads, q.shape[0] // self.shape.n_kv_heads
        qg = qr.astype(mx.float32).reshape(n_kv, rep, length, -1)
        s = (qg @ keys[:, None].swapaxes(-1, -2)) * scale
        s = mx.where(mx.array(positions[None, :] <= q_pos[:, None]), s, -mx.inf)
        w = mx.softmax(s, axis=-1, precise=True)
        out = w @ mx.array(self.values[:, ids])[:, None]
        self.mass[ids] += np.array(mx.sum(w, axis=(0, 1, 2)), dtype=np.float64)
        if eviction.quantizes(self.policy):
            self._quantize_aged()
        self._evict()
        return out.reshape(q.shape[0], length, -1)

    def _quantize_aged(self) -> None:
        """Group k of the main stream (tokens sinks + k*g ...) once (k+1)*g <= m - residual;
        without a window group 0 (the head) never."""
        p, g = self.policy, self.fmt.group_size
        m = max(0, self.n_seen - p.sinks)
        for k in range(eviction.head_groups(p), max(0, m - p.residual) // g):
            group = np.arange(p.sinks + k * g, p.sinks + (k + 1) * g)
            if self.quantized[group[0]] or not self.kept[group].all():
                continue
            kk, vv = mx.array(self.keys[:, group]), mx.array(self.values[:, group])
            self.keys[:, group] = np.array(dequantize_keys(*quantize_keys(kk, self.fmt), self.fmt))
            self.values[:, group] = np.array(dequantize_values(*quantize_values(vv, self.fmt), self.fmt))
            self.quantized[group] = True

    def _units(self) -> list[np.ndarray]:
        """Kept main-stream units in stream order: whole quantized groups, single other tokens."""
        p, g = self.policy, self.fmt.group_size
        units, i = [], p.sinks
        while i < self.n_seen:
            if self.quantized[i]:
                units.append(np.arange(i, i + g))
                i += g
            else:
                units.append(np.array([i]))
                i += 1
        return [u for u in units if self.kept[u[0]]]

    def _evict(self) -> None:
        p = self.policy
        if p.window is None:
            return
        edge = max(0, self.n_seen - p.sinks) - p.window
        left = [u for u in self._units() if u[-1] - p.sinks < edge]
        if not left:
            return
        budget = eviction.heavy_units(p)
        if eviction.quantizes(p):
            quant_left = [u for u in left if self.quantized[u[0]]]
            for u in left:
                if not self.quantized[u[0]]:
                    self.kept[u] = False
            left = quant_left
        ranked = sorted(left, key=lambda u: (float(np.float32(self.mass[u].sum())), u[0]), reverse=True)
        for u in ranked[budget:]:
            self.kept[u] = False

