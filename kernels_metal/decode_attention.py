"""Decode attention over a group-quantized K/V cache plus a full-precision tail.

One query token per head. Keys are stored before RoPE and rotated here at their in-cache
positions; 4- or 8-bit codes are dequantised in registers; grouped-query attention maps query
head h to KV head h // (Hq / Hkv); a sinks + window mask can hide keys (``window`` 0 = off).
``decode_attention`` runs the Metal kernel where Metal exists and the pure-MLX reference
(same signature) elsewhere. Both return (out (Hq, D), scores (Hq, N), lse (Hq,)): scores are
the scaled logits (-inf where masked), so softmax weights are exp(scores - lse) — what
heavy-hitter eviction accumulates.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from localctx.kernels_metal import metal
from localctx.kernels_metal.quant import QuantFormat, dequantize_keys, dequantize_values
from localctx.kernels_metal.rope import rope_at


@dataclass(frozen=True)
class QuantizedKV:
    """One layer's cache in kernel layout. Quantized slots come first, then full-precision ones;
    ``positions`` (Nq + Nf,) int32 holds each slot's in-cache position."""
    k_codes: mx.array  # (Hkv, Nq, D*bits/32) uint32
    k_scales: mx.array  # (Hkv, Nq/g, D) fp16, per channel
    k_mins: mx.array
    v_codes: mx.array  # (Hkv, Nq, D*bits/32) uint32
    v_scales: mx.array  # (Hkv, Nq, D/g) fp16, per token
    v_mins: mx.array
    k_full: mx.array  # (Hkv, Nf, D) pre-RoPE
    v_full: mx.array
    positions: mx.array

    @property
    def n_quantized(self) -> int:
        return int(self.k_codes.shape[1])

    @property
    def n_full(self) -> int:
        return int(self.k_full.shape[1])


@dataclass(frozen=True)
class DecodeParams:
    fmt: QuantFormat
    q_position: int
    scale: float
    traditional: bool
    sinks: int = 0
    window: int = 0  # 0 = no window mask


def visible_mask(positions: mx.array, p: DecodeParams) -> mx.array:
    ok = positions <= p.q_position
    if p.window:
        ok = mx.logical_and(ok, mx.logical_or(positions < p.sinks, p.q_position - positions < p.window))
    return ok


def dense_keys_values(kv: QuantizedKV, fmt: QuantFormat) -> tuple[mx.array, mx.array]:
    """Dequantised (Hkv, N, D) float32 keys (still pre-RoPE) and values, quantized slots first."""
    ks, vs = [kv.k_full.astype(mx.float32)], [kv.v_full.astype(mx.float32)]
    if kv.n_quantized:
        ks.insert(0, dequantize_keys(kv.k_codes, kv.k_scales, kv.k_mins, fmt))
        vs.insert(0, dequantize_values(kv.v_codes, kv.v_scales, kv.v_mins, fmt))
    return mx.concatenate(ks, axis=1), mx.concatenate(vs, axis=1)


def decode_attention_reference(q: mx.array, kv: QuantizedKV, inv_freq: mx.array,
                               p: DecodeParams) -> tuple[mx.array, mx.array, mx.array]:
    n_q_heads, d = q.shape
    n_kv = kv.k_full.shape[0]
    keys, values = dense_keys_values(kv, p.fmt)
    keys = rope_at(keys, kv.positions, inv_freq, p.traditional)
    qg = q.astype(mx.float32).reshape(n_kv, n_q_heads // n_kv, d)
    scores = (qg @ keys.swapaxes(-1, -2)) * p.scale  # (Hkv, rep, N)
    scores = mx.where(visible_mask(kv.positions, p)[None, None, :], scores, -mx.inf)
    lse = mx.logsumexp(scores, axis=-1, keepdims=True)
    weights = mx.where(mx.isinf(lse), 0.0, mx.exp(scores - lse))
    out = weights @ values
    return out.reshape(n_q_heads, d), scores.reshape(n_q_heads, -1), lse.reshape(n_q_heads)


SIMDGROUPS = 8
# Lane l of each simdgroup holds dims [l*E, l*E+E), E = D/32; simdgroups split the keys and
# merge their online-softmax states through threadgroup memory at the end.
_SOURCE = """
    constexpr int E = D / 32;
    constexpr int PER_WORD = 32 / BITS;
    constexpr uint LEVELS_MASK = (1u << BITS) - 1u;
    const uint lane = thread_index_in_simdgroup;
    const uint sg = simdgroup_index_in_threadgroup;
    const int head = threadgroup_position_in_grid.y;
    const int n_q = iparams[0];
    const int n_f = iparams[1];
    const int q_pos = iparams[2];
    const int sinks = iparams[3];
    const int window = iparams[4];
    const int rep = iparams[5];
    const int n_words = D / PER_WORD;
    const int kvh = head / rep;
    const int n_total = n_q + n_f;
    const float scale = fparams[0];
    const int d0 = lane * E;

    float qv[E];
    for (int e = 0; e < E; ++e) qv[e] = float(q[head * D + d0 + e]);
    float freq[E];
    for (int e = 0; e < E; ++e) {
        int d = d0 + e;
        freq[e] = inv_freq[TRAD ? d / 2 : d % (D / 2)];
    }
    float m = -INFINITY, l = 0.0f;
    float acc[E];
    for (int e = 0; e < E; ++e) acc[e] = 0.0f;

    for (int j = sg; j < n_total; j += SG) {
        const int pos = positions[j];
        const bool visible = pos <= q_pos && (window == 0 || pos < sinks || q_pos - pos < window);
        float kx[E], vx[E];
        if (j < n_q) {
            const uint kw = kc[(kvh * n_q + j) * n_words + d0 / PER_WORD];
            const uint vw = vc[(kvh * n_q + j) * n_words + d0 / PER_WORD];
            const int grp = j / G;
            for (int e = 0; e < E; ++e) {
                const int d = d0 + e;
                const uint shift = uint((d % PER_WORD) * BITS);
                const int kg = (kvh * (n_q / G) + grp) * D + d;
                kx[e] = float((kw >> shift) & LEVELS_MASK) * float(ks[kg]) + float(km[kg]);
                const int vg = (kvh * n_q + j) * (D / G) + d / G;
                vx[e] = float((vw >> shift) & LEVELS_MASK) * float(vs[vg]) + float(vm[vg]);
            }
        } else {
            const int jf = j - n_q;
            for (int e = 0; e < E; ++e) {
                kx[e] = float(kf[(kvh * n_f + jf) * D + d0 + e]);
                vx[e] = float(vf[(kvh * n_f + jf) * D + d0 + e]);
            }
        }
        float part = 0.0f;
        if (TRAD) {
            for (int e = 0; e < E; e += 2) {
                const float a = float(pos) * freq[e];
                const float c = metal::precise::cos(a), s = metal::precise::sin(a);
                part += qv[e] * (kx[e] * c - kx[e + 1] * s) + qv[e + 1] * (kx[e] * s + kx[e + 1] * c);
            }
        } else {
            const bool low = d0 < D / 2;
            for (int e = 0; e < E; ++e) {
                const float other = simd_shuffle_xor(kx[e], 16);
                const float a = float(pos) * freq[e];
                const float c = metal::precise::cos(a), s = metal::precise::sin(a);
                part += qv[e] * (low ? kx[e] * c - other * s : kx[e] * c + other * s);
            }
        }
        const float score = simd_sum(part) * scale;
        if (lane == 0) scores[head * n_total + j] = visible ? score : -INFINITY;
        if (visible) {
            const float m_new = max(m, score);
            const float corr = metal::exp(m - m_new);
            const float pj = metal::exp(score - m_new);
            l = l * corr + pj;
            for (int e = 0; e < E; ++e) acc[e] = acc[e] * corr + pj * vx[e];
            m = m_new;
        }
    }

    threadgroup float m_sh[SG];
    threadgroup float l_sh[SG];
    threadgroup float acc_sh[SG * D];
    if (lane == 0) { m_sh[sg] = m; l_sh[sg] = l; }
    for (int e = 0; e < E; ++e) acc_sh[sg * D + d0 + e] = acc[e];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
        float m_all = -INFINITY;
        for (int s = 0; s < SG; ++s) m_all = max(m_all, m_sh[s]);
        float l_all = 0.0f;
        float o[E];
        for (int e = 0; e < E; ++e) o[e] = 0.0f;
        for (int s = 0; s < SG; ++s) {
            const float w = (m_sh[s] == -INFINITY) ? 0.0f : metal::exp(m_sh[s] - m_all);
            l_all += l_sh[s] * w;
            for (int e = 0; e < E; ++e) o[e] += acc_sh[s * D + d0 + e] * w;
        }
        for (int e = 0; e < E; ++e) out[head * D + d0 + e] = l_all > 0.0f ? o[e] / l_all : 0.0f;
        if (lane == 0) lse[head] = l_all > 0.0f ? m_all + metal::log(l_all) : -INFINITY;
    }
"""

DECODE_KERNEL = metal.KernelSource(
    "localctx_decode_attention_q",
    ("q", "kc", "ks", "km", "vc", "vs", "vm", "kf", "vf", "positions", "inv_freq", "iparams", "fparams"),
    ("out", "scores", "lse"), _SOURCE)
_KERNEL = metal.build(DECODE_KERNEL)


def _nonempty(a: mx.array, shape: tuple, dtype) -> mx.array:
    """Metal buffers cannot be empty: stand in a one-element array for an empty store."""
    return a if a.size else mx.zeros(shape, dtype=dtype)


def decode_launch(q: mx.array, kv: QuantizedKV, inv_freq: mx.array, p: DecodeParams) -> metal.Launch:
    """The decode kernel's inputs, template values and grid: one threadgroup of SIMDGROUPS
    simdgroups per query head."""
    n_q_heads, d = q.shape
    n_kv = kv.k_full.shape[0]
    n_total = kv.n_quantized + kv.n_full
    iparams = mx.array([kv.n_quantized, kv.n_full, p.q_position, p.sinks, p.window, n_q_heads // n_kv],
                       dtype=mx.int32)
    inputs = [q.astype(mx.float32),
              _nonempty(kv.k_codes, (1,), mx.uint32), _nonempty(kv.k_scales, (1,), mx.float16),
              _nonempty(kv.k_mins, (1,), mx.float16), _nonempty(kv.v_codes, (1,), mx.uint32),
              _nonempty(kv.v_scales, (1,), mx.float16), _nonempty(kv.v_mins, (1,), mx.float16),
              _nonempty(kv.k_full, (1,), kv.k_full.dtype), _nonempty(kv.v_full, (1,), kv.v_full.dtype),
              kv.positions.astype(mx.int32), inv_freq.astype(mx.float32), iparams,
              mx.array([p.scale], dtype=mx.float32)]
    return metal.Launch(
        inputs=inputs,
        template=[("D", d), ("BITS", p.fmt.bits), ("G", p.fmt.group_size), ("TRAD", int(p.traditional)),
                  ("SG", SIMDGROUPS)],
        grid=(32, n_q_heads * SIMDGROUPS, 1), threadgroup=(32, SIMDGROUPS, 1),
        output_shapes=[(n_q_heads, d), (n_q_heads, n_total), (n_q_heads,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32])


def decode_attention_metal(q: mx.array, kv: QuantizedKV, inv_freq: mx.array,
                           p: DecodeParams) -> tuple[mx.array, mx.array, mx.array]:
    if _KERNEL is None:
        raise RuntimeError("the Metal decode-attention kernel needs Apple Metal; use the reference")
    out, scores, lse = decode_launch(q, kv, inv_freq, p).run(_KERNEL)
    return out, scores, lse


def decode_attention(q: mx.array, kv: QuantizedKV, inv_freq: mx.array,
                     p: DecodeParams) -> tuple[mx.array, mx.array, mx.array]:
    """The Metal kernel where Metal exists, else the reference."""
    if _KERNEL is not None and q.shape[-1] in (64, 128):
        return decode_attention_metal(q, kv, inv_freq, p)
    return decode_attention_reference(q, kv, inv_freq, p)


KERNEL_AVAILABLE = _KERNEL is not None
