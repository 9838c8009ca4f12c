"""Attention over a localctx policy cache inside an mlx-lm model (lm_cache.py), straight from the
quantized codes with ``mx.quantized_matmul`` instead of dequantizing the whole cache each step.

The store holds kvcache/quant.py's format (the same codes, scales and minimums, so the bytes are
``kvcache.cost.kv_bytes``), laid out for MLX's affine quantized matmul, which reads a matrix
quantized along its last axis (``w ≈ code * scale + bias``, codes packed low bits first):

- keys are quantized per channel over ``group_size`` tokens (KIVI), so they are kept transposed:
  codes (Hkv, D, Nq*bits/32) packed along the token axis, scales/mins (Hkv, D, Nq/g). Scores are
  ``q @ K^T`` = ``quantized_matmul(q, keys, transpose=False)``;
- values are quantized per token over ``group_size`` channels as usual: codes (Hkv, Nq, D*bits/32),
  scales/mins (Hkv, Nq, D/g); the output is ``quantized_matmul(weights, values, transpose=False)``.

The full-precision keys and values (sinks, the head group, the residual, the chunk's own tokens)
follow the quantized ones; mlx-lm's masks see the chunk's tokens last, as they are here."""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from localctx.kernels_metal.quant import QuantFormat, dequantize_values, pack, quantize_keys, quantize_values, unpack
from localctx.kernels_metal.quant_append import QuantStore


def empty_store(n_kv_heads: int, head_dim: int, fmt: QuantFormat) -> QuantStore:
    z = mx.zeros((n_kv_heads, head_dim, 0), mx.float16)
    return QuantStore(mx.zeros((n_kv_heads, head_dim, 0), mx.uint32), z, z,
                      mx.zeros((n_kv_heads, 0, fmt.packed_dim(head_dim)), mx.uint32),
                      mx.zeros((n_kv_heads, 0, head_dim // fmt.group_size), mx.float16),
                      mx.zeros((n_kv_heads, 0, head_dim // fmt.group_size), mx.float16))


def quantize_append(store: QuantStore, k_new: mx.array, v_new: mx.array, fmt: QuantFormat) -> QuantStore:
    """k_new, v_new (Hkv, T, D), T whole groups: quantized as kvcache/quant.py does, keys transposed."""
    codes, scales, mins = quantize_keys(k_new, fmt)
    k_codes = pack(unpack(codes, fmt.bits).swapaxes(-1, -2), fmt.bits)
    parts = (k_codes, scales.swapaxes(-1, -2), mins.swapaxes(-1, -2), *quantize_values(v_new, fmt))
    axes = (2, 2, 2, 1, 1, 1)
    return QuantStore(*(mx.concatenate([old, new], axis=a) for old, new, a in zip(store.arrays(), parts, axes)))


def keep_groups(store: QuantStore, groups: mx.array, fmt: QuantFormat) -> QuantStore:
    """The store with only the quantized groups ``groups`` (int32 indices, in order)."""
    g, words = fmt.group_size, fmt.group_size * fmt.bits // 32
    slots = (groups[:, None] * g + mx.arange(g)[None]).reshape(-1)
    key_words = (groups[:, None] * words + mx.arange(words)[None]).reshape(-1)
    return QuantStore(store.k_codes[..., key_words], store.k_scales[..., groups], store.k_mins[..., groups],
                      store.v_codes[:, slots], store.v_scales[:, slots], store.v_mins[:, slots])


def dense_keys(store: QuantStore, fmt: QuantFormat) -> mx.array:
    """(Hkv, Nq, D) float32 keys from the transposed codes."""
    c = unpack(store.k_codes, fmt.bits).astype(mx.float32)  # (Hkv, D, Nq)
    h, d, n = c.shape
    c = c.reshape(h, d, n // fmt.group_size, fmt.group_size)
    x = c * store.k_scales[..., None].astype(mx.float32) + store.k_mins[..., None].astype(mx.float32)
    return x.reshape(h, d, n).swapaxes(-1, -2)


@dataclass(frozen=True)
class HeldKV:
    """What one layer's attention sees in a step: the quantized store, then full-precision K/V
    (Hkv, Nf, D), keys rotated (mlx-lm applies RoPE before the cache sees them)."""
    store: QuantStore
    k_full: mx.array
    v_full: mx.array
    fmt: QuantFormat

    @property
    def n_quantized(self) -> int:
        return self.store.n_tokens

    def dense(self, quantized: tuple[mx.array, mx.array] | None = None) -> tuple[mx.array, mx.array]:
        """(Hkv, N, D) float32 keys and values, quantized first: the dequantize-then-attend form.
        ``quantized``: the store's part, dense_store() of this store, where the caller keeps it."""
        ks, vs = [self.k_full.astype(mx.float32)], [self.v_full.astype(mx.float32)]
        if self.n_quantized:
            k, v = quantized or self.dense_store()
            ks.insert(0, k)
            vs.insert(0, v)
        return mx.concatenate(ks, axis=1), mx.concatenate(vs, axis=1)

    def dense_store(self) -> tuple[mx.array, mx.array]:
        """(Hkv, Nq, D) float32 keys and values of the quantized store."""
        st = self.store
        return dense_keys(st, self.fmt), dequantize_values(st.v_codes, st.v_scales, st.v_mins, self.fmt)


def attention(queries: mx.array, held: HeldKV, scale: float, mask) -> mx.array:
    """queries (B, Hq, L, D) rotated; ``mask`` as mlx-lm passes it (None, "causal", a boolean or
    additive array over the held keys). Returns (B, Hq, L, D) in the queries' dtype."""
    dtype = queries.dtype
    if not held.n_quantized:
        k, v = held.k_full[None].astype(dtype), held.v_full[None].astype(dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    b, n_q_heads, length, d = queries.shape
    n_kv = held.k_full.shape[0]
    st, fmt = held.store, held.fmt
    q = (queries.astype(mx.float32) * scale).reshape(b, n_kv, n_q_heads // n_kv, length, d)
    kw = dict(transpose=False, group_size=fmt.group_size, bits=fmt.bits)
    scores = mx.quantized_matmul(q, st.k_codes[:, None], st.k_scales[:, None], st.k_mins[:, None], **kw)
    if held.k_full.shape[1]:
        full = q @ held.k_full.astype(mx.float32)[:, None].swapaxes(-1, -2)
        scores = mx.concatenate([scores, full], axis=-1)  # (B, Hkv, rep, L, N)
    if isinstance(mask, str):
        n = scores.shape[-1]
        mask = mx.arange(n - length, n)[:, None] >= mx.arange(n)[None]
    if mask is not None:
        if mask.ndim > 3:  # (B, H or 1, L, N): the query heads of a KV head share it
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -mx.inf)
        else:
            scores = scores + mask.astype(mx.float32)
    weights = mx.softmax(scores, axis=-1, precise=True)
    nq = held.n_quantized
    out = mx.quantized_matmul(weights[..., :nq], st.v_codes[:, None], st.v_scales[:, None], st.v_mins[:, None], **kw)
    if held.k_full.shape[1]:
        out = out + weights[..., nq:] @ held.v_full.astype(mx.float32)[:, None]
    return out.reshape(b, n_q_heads, length, d).astype(dtype)
