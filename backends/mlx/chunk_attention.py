"""Attention over one layer's cache for a chunk of queries (prefill), in pure MLX: causal over
in-cache positions (``chunk_attention``), or masked per query as decoding would see the cache
(``view_attention``, for chunks in which groups age or tokens leave the window).

Decode (one query) goes through kernels_metal.decode_attention instead; both see every key at
its in-cache position, rotated there (keys are cached before RoPE)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from localctx.kernels_metal.decode_attention import QuantizedKV, dense_keys_values
from localctx.kernels_metal.quant import QuantFormat
from localctx.kernels_metal.rope import rope_at
from localctx.kvcache.chunk_view import ChunkView


def chunk_attention(q: mx.array, kv: QuantizedKV, q_positions: mx.array, inv_freq: mx.array,
                    fmt: QuantFormat, scale: float, traditional: bool, window: int | None = None,
                    sinks: int = 0) -> tuple[mx.array, mx.array]:
    """q (Hq, L, D) already rotated at ``q_positions``. A key is visible to a query when its
    in-cache position is not later than the query's (and, on a layer sliding over its own
    ``window``, within the window or among the first ``sinks`` positions). Returns (out (Hq, L, D)
    float32, attention weight each slot received, summed over heads and queries (N,) float32)."""
    n_q_heads, length, d = q.shape
    n_kv = kv.k_full.shape[0]
    keys, values = dense_keys_values(kv, fmt)
    keys = rope_at(keys, kv.positions, inv_freq, traditional)
    qg = q.astype(mx.float32).reshape(n_kv, n_q_heads // n_kv, length, d)
    scores = (qg @ keys[:, None].swapaxes(-1, -2)) * scale  # (Hkv, rep, L, N)
    visible = kv.positions[None, :] <= q_positions[:, None]  # (L, N)
    if window is not None:
        visible = visible & ((kv.positions[None, :] > q_positions[:, None] - window) | (kv.positions[None, :] < sinks))
    scores = mx.where(visible, scores, -mx.inf)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = weights @ values[:, None]
    return out.reshape(n_q_heads, length, d), mx.sum(weights, axis=(0, 1, 2))


def view_attention(q: mx.array, keys: mx.array, values: mx.array, view: ChunkView, inv_freq: mx.array,
                   scale: float, traditional: bool) -> mx.array:
    """A chunk's attention where ``view`` (numpy arrays, ``kvcache.chunk_view``) says which keys
    each query sees and at what distance: q (Hq, L, D) and keys/values (Hkv, N, D) float32, all
    before RoPE. Keys in a frame of their own (the sinks, once eviction moved them closer) are
    scored against the query rotated in that frame. Returns (Hq, L, D) float32."""
    n_q_heads, length, d = q.shape
    n_kv = keys.shape[0]

    kr = rope_at(keys, mx.array(view.key_positions.astype(np.int32)), inv_freq, traditional)[:, None]

    def scores_at(q_positions: np.ndarray) -> mx.array:
        qr = rope_at(q, mx.array(q_positions.astype(np.int32)), inv_freq, traditional)
        return qr.reshape(n_kv, n_q_heads // n_kv, length, d) @ kr.swapaxes(-1, -2)  # (Hkv, rep, L, N)

    scores = scores_at(view.q_positions)
    if view.sink_keys is not None:
        sink_scores = scores_at(view.q_sink_positions)
        scores = mx.where(mx.array(view.sink_keys), sink_scores, scores)
    scores = mx.where(mx.array(view.visible), scores * scale, -mx.inf)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values[:, None]).reshape(n_q_heads, length, d)
