"""RoPE at arbitrary per-token positions (keys are cached before RoPE and rotated at their
in-cache positions at attention time). ``traditional`` rotates adjacent pairs (2i, 2i+1), the
layout of llama.cpp's permuted Q/K; otherwise halves (i, i + D/2), the Hugging Face layout."""
from __future__ import annotations

import mlx.core as mx


def inv_frequencies(head_dim: int, base: float, freq_factors: mx.array | None = None) -> mx.array:
    """(D/2,) float32 angular speeds; ``freq_factors`` divides them (llama.cpp's rope_freqs)."""
    exps = mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim
    inv = mx.power(mx.array(base, dtype=mx.float32), -exps)
    if freq_factors is not None:
        inv = inv / freq_factors.astype(mx.float32)
    return inv


def rope_at(x: mx.array, positions: mx.array, inv_freq: mx.array, traditional: bool) -> mx.array:
    """Rotate x (..., T, D) with token t at ``positions[t]``; computed in float32."""
    angles = positions.astype(mx.float32)[:, None] * inv_freq[None, :]  # (T, D/2)
    cos, sin = mx.cos(angles), mx.sin(angles)
    x32 = x.astype(mx.float32)
    if traditional:
        pairs = x32.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
        return out.reshape(x.shape)
    half = x.shape[-1] // 2
    a, b = x32[..., :half], x32[..., half:]
    return mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
