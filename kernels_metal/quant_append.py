"""Quantise-and-append: new K/V tokens (whole groups) join a group-quantized cache store.

Keys are quantized per channel over each group of ``group_size`` tokens, values per token over
``group_size`` channels (see quant.py for the format). ``quantize_append`` quantizes with the
Metal kernels where Metal exists and the pure-MLX reference elsewhere, then appends the codes,
scales and mins along the token axis. MLX arrays are immutable, so "append" returns the grown
store."""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from localctx.kernels_metal import metal
from localctx.kernels_metal.quant import QuantFormat, quantize_keys, quantize_values


@dataclass(frozen=True)
class QuantStore:
    """(Hkv, N, ...) arrays of one layer's quantized tokens, N a multiple of the group size."""
    k_codes: mx.array
    k_scales: mx.array
    k_mins: mx.array
    v_codes: mx.array
    v_scales: mx.array
    v_mins: mx.array

    @classmethod
    def empty(cls, n_kv_heads: int, head_dim: int, fmt: QuantFormat) -> "QuantStore":
        w = fmt.packed_dim(head_dim)
        return cls(mx.zeros((n_kv_heads, 0, w), mx.uint32), mx.zeros((n_kv_heads, 0, head_dim), mx.float16),
                   mx.zeros((n_kv_heads, 0, head_dim), mx.float16), mx.zeros((n_kv_heads, 0, w), mx.uint32),
                   mx.zeros((n_kv_heads, 0, head_dim // fmt.group_size), mx.float16),
                   mx.zeros((n_kv_heads, 0, head_dim // fmt.group_size), mx.float16))

    @property
    def n_tokens(self) -> int:
        return int(self.v_codes.shape[1])  # values are (Hkv, N, ...) in every layout

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.k_codes, self.k_scales, self.k_mins, self.v_codes, self.v_scales,
                                      self.v_mins))

    def arrays(self) -> tuple[mx.array, ...]:
        return (self.k_codes, self.k_scales, self.k_mins, self.v_codes, self.v_scales, self.v_mins)


def _check(k_new: mx.array, fmt: QuantFormat) -> None:
    t, d = k_new.shape[-2:]
    if t % fmt.group_size or d % fmt.group_size or d % fmt.per_word:
        raise ValueError(f"quantize_append needs whole groups: {t} tokens x {d} dims, group {fmt.group_size}")


def _append(store: QuantStore, parts: tuple[mx.array, ...]) -> QuantStore:
    return QuantStore(*(mx.concatenate([old, new], axis=1) for old, new in zip(store.arrays(), parts)))


def quantize_append_reference(store: QuantStore, k_new: mx.array, v_new: mx.array,
                              fmt: QuantFormat) -> QuantStore:
    """k_new, v_new: (Hkv, T, D), T a multiple of the group size."""
    _check(k_new, fmt)
    return _append(store, quantize_keys(k_new, fmt) + quantize_values(v_new, fmt))


# one thread per (packed word, group of G tokens, head): per-channel scale/min over G tokens
_KEYS_SOURCE = """
    constexpr int PER_WORD = 32 / BITS;
    constexpr float LEVELS = float((1 << BITS) - 1);
    const int w = thread_position_in_grid.x;
    const int grp = thread_position_in_grid.y;
    const int h = thread_position_in_grid.z;
    const int n_groups = threads_per_grid.y;
    const int n_words = D / PER_WORD;
    const int T = n_groups * G;
    float lo16[PER_WORD], step[PER_WORD];
    for (int c = 0; c < PER_WORD; ++c) {
        const int d = w * PER_WORD + c;
        float lo = INFINITY, hi = -INFINITY;
        for (int t = 0; t < G; ++t) {
            const float x = float(k[(h * T + grp * G + t) * D + d]);
            lo = min(lo, x); hi = max(hi, x);
        }
        const half l16 = half(lo);
        const half s = half((hi - float(l16)) / LEVELS);
        scales[(h * n_groups + grp) * D + d] = s;
        mins[(h * n_groups + grp) * D + d] = l16;
        lo16[c] = float(l16);
        step[c] = float(s) > 0.0f ? float(s) : 1.0f;
    }
    for (int t = 0; t < G; ++t) {
        uint word = 0;
        for (int c = 0; c < PER_WORD; ++c) {
            const float x = float(k[(h * T + grp * G + t) * D + w * PER_WORD + c]);
            const float code = clamp(metal::rint((x - lo16[c]) / step[c]), 0.0f, LEVELS);
            word |= uint(code) << uint(c * BITS);
        }
        codes[(h * T + grp * G + t) * n_words + w] = word;
    }
"""
# one thread per (channel group, token, head): per-token scale/min over G channels
_VALUES_SOURCE = """
    constexpr int PER_WORD = 32 / BITS;
    constexpr float LEVELS = float((1 << BITS) - 1);
    const int cg = thread_position_in_grid.x;
    const int t = thread_position_in_grid.y;
    const int h = thread_position_in_grid.z;
    const int T = threads_per_grid.y;
    const int n_words = D / PER_WORD;
    const int base = (h * T + t) * D + cg * G;
    float lo = INFINITY, hi = -INFINITY;
    for (int c = 0; c < G; ++c) { const float x = float(v[base + c]); lo = min(lo, x); hi = max(hi, x); }
    const half l16 = half(lo);
    const half s = half((hi - float(l16)) / LEVELS);
    scales[(h * T + t) * (D / G) + cg] = s;
    mins[(h * T + t) * (D / G) + cg] = l16;
    const float step = float(s) > 0.0f ? float(s) : 1.0f;
    for (int wi = 0; wi < G / PER_WORD; ++wi) {
        uint word = 0;
        for (int c = 0; c < PER_WORD; ++c) {
            const float x = float(v[base + wi * PER_WORD + c]);
            const float code = clamp(metal::rint((x - float(l16)) / step), 0.0f, LEVELS);
            word |= uint(code) << uint(c * BITS);
        }
        codes[(h * T + t) * n_words + cg * (G / PER_WORD) + wi] = word;
    }
"""

KEYS_KERNEL = metal.KernelSource("localctx_quantize_keys", ("k",), ("codes", "scales", "mins"), _KEYS_SOURCE)
VALUES_KERNEL = metal.KernelSource("localctx_quantize_values", ("v",), ("codes", "scales", "mins"), _VALUES_SOURCE)
_KEYS_KERNEL = metal.build(KEYS_KERNEL)
_VALUES_KERNEL = metal.build(VALUES_KERNEL)
KERNEL_AVAILABLE = _KEYS_KERNEL is not None and _VALUES_KERNEL is not None


def quantize_launches(k_new: mx.array, v_new: mx.array, fmt: QuantFormat) -> tuple[metal.Launch, metal.Launch]:
    """Launches of the key kernel (a thread per packed word per group of tokens per head) and
    the value kernel (a thread per channel group per token per head)."""
    _check(k_new, fmt)
    h, t, d = k_new.shape
    g, w = fmt.group_size, fmt.packed_dim(d)
    template = [("D", d), ("BITS", fmt.bits), ("G", g)]
    keys = metal.Launch([k_new], template, (w, t // g, h), (min(w, 32), 1, 1),
                        [(h, t, w), (h, t // g, d), (h, t // g, d)], [mx.uint32, mx.float16, mx.float16])
    values = metal.Launch([v_new], template, (d // g, t, h), (d // g, 1, 1),
                          [(h, t, w), (h, t, d // g), (h, t, d // g)], [mx.uint32, mx.float16, mx.float16])
    return keys, values


def quantize_append_metal(store: QuantStore, k_new: mx.array, v_new: mx.array, fmt: QuantFormat) -> QuantStore:
    if not KERNEL_AVAILABLE:
        raise RuntimeError("the Metal quantise-and-append kernels need Apple Metal; use the reference")
    keys, values = quantize_launches(k_new, v_new, fmt)
    return _append(store, tuple(keys.run(_KEYS_KERNEL)) + tuple(values.run(_VALUES_KERNEL)))


def quantize_append(store: QuantStore, k_new: mx.array, v_new: mx.array, fmt: QuantFormat) -> QuantStore:
    """The Metal kernels where Metal exists, else the reference."""
    if KERNEL_AVAILABLE:
        return quantize_append_metal(store, k_new, v_new, fmt)
    return quantize_append_reference(store, k_new, v_new, fmt)
