"""Group-wise affine quantization of K/V in pure MLX: the reference the Metal kernels match.

A group of ``group_size`` elements stores ``scale`` and ``min`` (fp16 each) and one code per
element: ``x ≈ code * scale + min`` with ``code`` in [0, 2**bits - 1]. Keys are grouped per
channel over ``group_size`` consecutive tokens (KIVI: key outliers live in channels); values
per token over ``group_size`` consecutive channels. Codes are packed along the channel axis,
``32 // bits`` codes per uint32, the first code in the lowest bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

SCALE_DTYPE = mx.float16


@dataclass(frozen=True)
class QuantFormat:
    bits: int  # 4 or 8
    group_size: int  # 32 or 64

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def packed_dim(self, head_dim: int) -> int:
        return head_dim // self.per_word


def pack(codes: mx.array, bits: int) -> mx.array:
    """(..., D) integer codes → (..., D * bits / 32) uint32."""
    per_word = 32 // bits
    shape = codes.shape
    c = codes.astype(mx.uint32).reshape(*shape[:-1], shape[-1] // per_word, per_word)
    shifts = (mx.arange(per_word, dtype=mx.uint32) * bits)
    return mx.sum(mx.left_shift(c, shifts), axis=-1).astype(mx.uint32)


def unpack(words: mx.array, bits: int) -> mx.array:
    """(..., W) uint32 → (..., W * 32 / bits) uint32 codes."""
    per_word = 32 // bits
    shifts = (mx.arange(per_word, dtype=mx.uint32) * bits)
    mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
    c = mx.bitwise_and(mx.right_shift(words[..., None], shifts), mask)
    return c.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def _affine(x: mx.array, axis: int, fmt: QuantFormat) -> tuple[mx.array, mx.array, mx.array]:
    """Codes, scale, min of groups that span ``axis`` (already reshaped so a group is that axis).
    The min is rounded to fp16 first and the scale measured from it; codes are computed against
    the fp16 scale and min, so dequantising reproduces what the codes were fitted to (the same
    arithmetic as kvcache/quant.py)."""
    x = x.astype(mx.float32)
    lo16 = mx.min(x, axis=axis, keepdims=True).astype(SCALE_DTYPE)
    hi = mx.max(x, axis=axis, keepdims=True)
    scale = ((hi - lo16.astype(mx.float32)) / fmt.levels).astype(SCALE_DTYPE)
    s32 = scale.astype(mx.float32)
    safe = mx.where(s32 > 0, s32, 1.0)
    codes = mx.clip(mx.round((x - lo16.astype(mx.float32)) / safe), 0, fmt.levels)
    return codes, scale, lo16


def quantize_keys(k: mx.array, fmt: QuantFormat) -> tuple[mx.array, mx.array, mx.array]:
    """k (..., T, D) with T a multiple of the group size → (codes (..., T, D*b/32) uint32,
    scales (..., T/g, D) fp16, mins (..., T/g, D) fp16): one group per channel per g tokens."""
    *lead, t, d = k.shape
    g = fmt.group_size
    grouped = k.reshape(*lead, t // g, g, d)
    codes, scale, lo = _affine(grouped, -2, fmt)
    codes = codes.reshape(*lead, t, d)
    return pack(codes, fmt.bits), scale.squeeze(-2), lo.squeeze(-2)


def dequantize_keys(codes: mx.array, scales: mx.array, mins: mx.array, fmt: QuantFormat) -> mx.array:
    *lead, t, _ = codes.shape
    c = unpack(codes, fmt.bits).astype(mx.float32)
    d = c.shape[-1]
    g = fmt.group_size
    c = c.reshape(*lead, t // g, g, d)
    x = c * scales[..., None, :].astype(mx.float32) + mins[..., None, :].astype(mx.float32)
    return x.reshape(*lead, t, d)


def quantize_values(v: mx.array, fmt: QuantFormat) -> tuple[mx.array, mx.array, mx.array]:
    """v (..., T, D) → (codes (..., T, D*b/32) uint32, scales (..., T, D/g), mins (..., T, D/g))."""
    *lead, t, d = v.shape
    g = fmt.group_size
    grouped = v.reshape(*lead, t, d // g, g)
    codes, scale, lo = _affine(grouped, -1, fmt)
    return pack(codes.reshape(*lead, t, d), fmt.bits), scale.squeeze(-1), lo.squeeze(-1)


def dequantize_values(codes: mx.array, scales: mx.array, mins: mx.array, fmt: QuantFormat) -> mx.array:
    *lead, t, _ = codes.shape
    c = unpack(codes, fmt.bits).astype(mx.float32)
    d = c.shape[-1]
    g = fmt.group_size
    c = c.reshape(*lead, t, d // g, g)
    x = c * scales[..., None].astype(mx.float32) + mins[..., None].astype(mx.float32)
    return x.reshape(*lead, t, d)

