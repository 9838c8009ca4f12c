"""localctx's KV policies as MLX caches: one ``LayerCache`` per layer, every combination of
precision (fp16 / int8 / int4 + residual), sinks + window and heavy hitters.

Layout of one layer: a group-quantized store (whole groups of ``group_size`` token slots) and a
full-precision tail, both holding keys *before* RoPE. Attention rotates each key at its
position in the cache (its rank among the kept tokens) and the query at the next position, so
attention sinks stream past the trained context (StreamingLLM). Tokens enter the tail; once the
tail holds ``residual + group_size`` tokens its oldest ``group_size`` are quantized (keys per
channel, values per token). An evicted token leaves a hole in its slot; the oldest tail token
fills it (a key group keeps its per-channel range unless the newcomer falls outside it, so the
other members keep their codes), so the store stays whole groups and the bytes held equal
``kvcache.cost.kv_bytes`` for the same policy and token count.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from localctx.backends.mlx.attention import chunk_attention
from localctx.backends.mlx.eviction import victims
from localctx.kernels_metal.decode_attention import DecodeParams, QuantizedKV, decode_attention
from localctx.kernels_metal.quant import (QuantFormat, dequantize_keys, quantize_values,
                                          requantize_key_groups)
from localctx.kernels_metal.quant_append import QuantStore, quantize_append
from localctx.kernels_metal.rope import rope_at
from localctx.kvcache.policy import KVPolicy


@dataclass(frozen=True)
class CacheShape:
    n_kv_heads: int
    head_dim: int
    full_dtype: mx.Dtype  # float16, or float32 for fp32 models (kvcache spec's kv_elem_bytes)
    traditional_rope: bool


class LayerCache:
    def __init__(self, policy: KVPolicy, shape: CacheShape, inv_freq: mx.array):
        self.policy = policy
        self.shape = shape
        self.inv_freq = inv_freq
        self.fmt = QuantFormat(policy.bits if policy.quantized else 8, policy.group_size)
        self.reset()

    def reset(self) -> None:
        s = self.shape
        self.store = QuantStore.empty(s.n_kv_heads, s.head_dim, self.fmt)
        self.q_ids = np.zeros(0, dtype=np.int64)
        self.q_scores = np.zeros(0, dtype=np.float64)
        self.k_full = mx.zeros((s.n_kv_heads, 0, s.head_dim), s.full_dtype)
        self.v_full = mx.zeros((s.n_kv_heads, 0, s.head_dim), s.full_dtype)
        self.f_ids = np.zeros(0, dtype=np.int64)
        self.f_scores = np.zeros(0, dtype=np.float64)
        self.n_seen = 0

    # -- what it holds ------------------------------------------------------------
    @property
    def n_kept(self) -> int:
        return len(self.q_ids) + len(self.f_ids)

    def nbytes(self) -> int:
        full = self.k_full.nbytes + self.v_full.nbytes
        return full + (self.store.nbytes() if self.store.n_tokens else 0)

    def kept_ids(self) -> np.ndarray:
        return np.sort(np.concatenate([self.q_ids, self.f_ids]))

    def _positions(self) -> mx.array:
        ids = np.concatenate([self.q_ids, self.f_ids])
        ranks = np.empty(len(ids), dtype=np.int32)
        ranks[np.argsort(ids, kind="stable")] = np.arange(len(ids), dtype=np.int32)
        return mx.array(ranks)

    def _view(self) -> QuantizedKV:
        st = self.store
        return QuantizedKV(st.k_codes, st.k_scales, st.k_mins, st.v_codes, st.v_scales, st.v_mins,
                           self.k_full, self.v_full, self._positions())

    # -- the one call attention makes -----------------------------------------------
    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """q (Hq, L, D), k/v (Hkv, L, D), all before RoPE. Appends the L tokens, attends (query
        i sees the cache and the chunk's tokens up to i), then evicts and quantizes per policy.
        Returns (Hq, L, D) float32."""
        length = q.shape[1]
        first = self.n_kept
        q_pos = mx.arange(first, first + length, dtype=mx.int32)
        q_rot = rope_at(q, q_pos, self.inv_freq, self.shape.traditional_rope)
        self.k_full = mx.concatenate([self.k_full, k.astype(self.shape.full_dtype)], axis=1)
        self.v_full = mx.concatenate([self.v_full, v.astype(self.shape.full_dtype)], axis=1)
        self.f_ids = np.concatenate([self.f_ids, np.arange(self.n_seen, self.n_seen + length)])
        self.f_scores = np.concatenate([self.f_scores, np.zeros(length)])
        self.n_seen += length
        kv = self._view()
        if length == 1:
            params = DecodeParams(self.fmt, first, scale, self.shape.traditional_rope)
            out, scores, lse = decode_attention(q_rot[:, 0], kv, self.inv_freq, params)
            out = out[:, None]
            received = mx.sum(mx.exp(scores - lse[:, None]), axis=0) if self.policy.heavy else None
        else:
            out, received = chunk_attention(q_rot, kv, q_pos, self.inv_freq, self.fmt, scale,
                                             self.shape.traditional_rope)
        if self.policy.heavy:
            got = np.array(received.astype(mx.float32), dtype=np.float64)
            nq = len(self.q_ids)
            self.q_scores = self.q_scores + got[:nq]
            self.f_scores = self.f_scores + got[nq:]
        if self.policy.evicts:
            self._evict()
        if self.policy.quantized:
            self._quantize_aged()
        return out

    # -- rolling back to a prefix (a chat turn that rewrites the last answer) ------------
    def can_truncate(self, n: int) -> bool:
        """True when dropping every token from stream index ``n`` on leaves exactly the state a
        fresh stream of ``n`` tokens would have: nothing evicted yet, no heavy-hitter history, and
        the quantized groups are those ``n`` tokens would have formed."""
        if n > self.n_seen or self.n_kept != self.n_seen or self.policy.heavy:
            return False
        if not self.policy.quantized:
            return True
        g = self.fmt.group_size
        return len(self.q_ids) == max(0, n - self.policy.residual) // g * g and len(self.q_ids) <= n

    def truncate(self, n: int) -> None:
        if not self.can_truncate(n):
            raise ValueError(f"cannot roll this cache back to {n} tokens")
        keep = np.flatnonzero(self.f_ids < n)
        idx = mx.array(keep.astype(np.int32))
        self.k_full, self.v_full = self.k_full[:, idx], self.v_full[:, idx]
        self.f_ids, self.f_scores = self.f_ids[keep], self.f_scores[keep]
        self.n_seen = n

    # -- eviction ---------------------------------------------------------------------
    def _evict(self) -> None:
        ids = np.concatenate([self.q_ids, self.f_ids])
        scores = np.concatenate([self.q_scores, self.f_scores])
        drop = victims(self.policy, ids, scores, self.n_seen)
        if not drop.any():
            return
        nq = len(self.q_ids)
        f_keep = np.flatnonzero(~drop[nq:])
        if len(f_keep) < len(self.f_ids):
            idx = mx.array(f_keep.astype(np.int32))
            self.k_full, self.v_full = self.k_full[:, idx], self.v_full[:, idx]
            self.f_ids, self.f_scores = self.f_ids[f_keep], self.f_scores[f_keep]
        holes = np.flatnonzero(drop[:nq])
        if len(holes):
            self._fill_holes(holes)

    def _fill_holes(self, holes: np.ndarray) -> None:
        """Move the oldest tail tokens into the quantized slots that evicted tokens left."""
        n = len(holes)
        if n > len(self.f_ids):
            raise AssertionError("cache invariant broken: more holes than tail tokens to fill them")
        fmt, g = self.fmt, self.fmt.group_size
        st = self.store
        k_in, v_in = self.k_full[:, :n], self.v_full[:, :n]
        slots = mx.array(holes.astype(np.int32))
        vc, vs, vm = quantize_values(v_in, fmt)
        v_codes, v_scales, v_mins = st.v_codes, st.v_scales, st.v_mins
        v_codes[:, slots], v_scales[:, slots], v_mins[:, slots] = vc, vs, vm
        groups = np.unique(holes // g)
        members = (groups[:, None] * g + np.arange(g)[None, :]).reshape(-1)
        member_idx = mx.array(members.astype(np.int32))
        group_idx = mx.array(groups.astype(np.int32))
        dense = dequantize_keys(st.k_codes[:, member_idx], st.k_scales[:, group_idx], st.k_mins[:, group_idx], fmt)
        local = mx.array(np.searchsorted(members, holes).astype(np.int32))
        dense[:, local] = k_in.astype(mx.float32)
        kc, ks, km = requantize_key_groups(dense, st.k_scales[:, group_idx], st.k_mins[:, group_idx], fmt)
        k_codes, k_scales, k_mins = st.k_codes, st.k_scales, st.k_mins
        k_codes[:, member_idx], k_scales[:, group_idx], k_mins[:, group_idx] = kc, ks, km
        self.store = QuantStore(k_codes, k_scales, k_mins, v_codes, v_scales, v_mins)
        self.q_ids = self.q_ids.copy()
        self.q_scores = self.q_scores.copy()
        self.q_ids[holes], self.q_scores[holes] = self.f_ids[:n], self.f_scores[:n]
        self.k_full, self.v_full = self.k_full[:, n:], self.v_full[:, n:]
        self.f_ids, self.f_scores = self.f_ids[n:], self.f_scores[n:]

    # -- quantization as tokens age ----------------------------------------------------
    def _quantize_aged(self) -> None:
        g = self.fmt.group_size
        n_groups = max(0, len(self.f_ids) - self.policy.residual) // g
        if not n_groups:
            return
        n = n_groups * g
        self.store = quantize_append(self.store, self.k_full[:, :n], self.v_full[:, :n], self.fmt)
        self.q_ids = np.concatenate([self.q_ids, self.f_ids[:n]])
        self.q_scores = np.concatenate([self.q_scores, self.f_scores[:n]])
        self.k_full, self.v_full = self.k_full[:, n:], self.v_full[:, n:]
        self.f_ids, self.f_scores = self.f_ids[n:], self.f_scores[n:]


class ModelCache:
    """The caches of every layer, and what the UI reads: bytes, tokens held, tokens evicted."""

    def __init__(self, policy: KVPolicy, n_layers: int, shape: CacheShape, inv_freq: mx.array):
        self.policy = policy
        self.layers = [LayerCache(policy, shape, inv_freq) for _ in range(n_layers)]

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    @property
    def n_seen(self) -> int:
        return self.layers[0].n_seen

    @property
    def n_kept(self) -> int:
        return self.layers[0].n_kept

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def truncate(self, n: int) -> bool:
        """Roll every layer back to the first ``n`` tokens when that is exact; False otherwise."""
        if not all(layer.can_truncate(n) for layer in self.layers):
            return False
        for layer in self.layers:
            layer.truncate(n)
        return True

    def arrays(self) -> list[mx.array]:
        """Every array the caches hold (to evaluate them with the step's logits)."""
        return [a for layer in self.layers for a in (layer.k_full, layer.v_full, *layer.store.arrays())]

    def probe(self) -> tuple[int, int, int]:
        """(kv bytes, tokens held, tokens evicted) for backends.streaming.KVProbe."""
        return self.nbytes(), self.n_kept, self.n_seen - self.n_kept
