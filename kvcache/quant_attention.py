"""Attention over a policy cache's full-precision and quantized tokens: the pure-torch reference.

The fused kernels (kernels_cuda/, kernels_metal/) replace ``attend_reference`` behind the same
signature and must return the same result (the tests compare kernel to this function).

One call covers one layer of one sequence. Its inputs:

- ``q``: [T, n_heads, D] queries of the T new tokens, **before RoPE**; ``q_positions``: [T]
  their in-cache positions (long).
- ``full``: the full-precision tokens (sinks, the head group of an unbounded quantized cache,
  the recent residual, the new tokens themselves, and any full-precision heavy hitters):
  ``k``, ``v`` [n_kv_heads, N, D] keys **before RoPE**, ``positions`` [N] in-cache positions.
- ``quant``: the quantized groups (or None), ``G`` groups of ``g`` tokens, layout of
  ``kvcache/quant.py``: keys ``k.codes`` uint8 [G, Hkv, g, D*bits/8], ``k.scale``/``k.min``
  fp16 [G, Hkv, 1, D] (per channel over the group's tokens); values ``v.codes`` uint8
  [G, Hkv, g, D*bits/8], ``v.scale``/``v.min`` fp16 [G, Hkv, g, D/g] (per token over g
  channels); ``positions`` [G, g] in-cache positions. 4-bit codes: two per byte, even channel
  in the low nibble. Keys and values may differ in bits (k8v4), and a side at 16 bits (kf16v4's
  keys) is a ``FullGroups`` [G, Hkv, g, D] in the model's dtype; a kernel that takes one
  precision for both sides serves only ``QuantGroups.uniform_bits``.
- ``rope``: the model's rotary embedding (``rotate(x [B,T,H,D], positions [B,T])``). Every key
  is rotated at its in-cache position here, every query at its own: positions are re-indexed
  inside the cache, so eviction never touches stored keys.

A key is visible to a query iff its position ≤ the query's position (causal in cache order).
Grouped-query attention: query head h reads KV head h // (n_heads / n_kv_heads).

With ``want_mass`` the result also carries each key's attention mass (softmax probabilities
summed over the T queries and all query heads), which heavy-hitter eviction accumulates.

``attend_visible`` is the same attention with the visibility given per query (a
``kvcache.chunk_view.ChunkView`` over the keys in ``gather_keys_values`` order: quantized groups
first, then the full-precision tokens): a chunk of prefill whose queries, as in decoding, see different keys — the window moving, groups
aged into their quantized form (the key list then holds both forms of those tokens), and the
sinks at positions that eviction has moved closer (``kvcache/chunk_view.py`` builds the view).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localctx.kvcache.chunk_view import ChunkView
from localctx.kvcache.quant import FullGroups, QuantizedTensor, dequantize_keys, dequantize_values


@dataclass(frozen=True)
class FullTokens:
    k: torch.Tensor  # [Hkv, N, D] before RoPE
    v: torch.Tensor  # [Hkv, N, D]
    positions: torch.Tensor  # [N] long


@dataclass(frozen=True)
class QuantGroups:
    k: QuantizedTensor | FullGroups  # codes [G, Hkv, g, D*bits/8], scale/min [G, Hkv, 1, D]
    v: QuantizedTensor | FullGroups  # codes [G, Hkv, g, D*bits/8], scale/min [G, Hkv, g, D/g]
    positions: torch.Tensor  # [G, g] long
    group_size: int

    @property
    def n_groups(self) -> int:
        return self.positions.shape[0]

    @property
    def uniform_bits(self) -> int | None:
        """The bits of both sides when keys and values are quantized alike (what a fused kernel
        takes); None for a split (k8v4, kf16v4), which only the reference serves."""
        return self.k.bits if self.k.bits == self.v.bits < 16 else None


@dataclass(frozen=True)
class AttentionResult:
    out: torch.Tensor  # [T, n_heads, D]
    full_mass: torch.Tensor | None = None  # [N] float32
    quant_mass: torch.Tensor | None = None  # [G, g] float32


def _rotate(rope, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x: [H, L, D] at positions [L] → rotated [H, L, D]."""
    return rope.rotate(x.transpose(0, 1).unsqueeze(0), positions.unsqueeze(0))[0].transpose(0, 1)


def gather_keys_values(full: FullTokens, quant: QuantGroups | None, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All keys and values in full precision ([Hkv, L, D], quantized groups first) and their positions [L]."""
    if quant is None or quant.n_groups == 0:
        return full.k.to(dtype), full.v.to(dtype), full.positions
    G, H, g = quant.positions.shape[0], full.k.shape[0], quant.group_size
    D = full.k.shape[-1]
    kq = quant.k.data.to(dtype) if quant.k.bits == 16 else dequantize_keys(quant.k, dtype)
    vq = quant.v.data.to(dtype) if quant.v.bits == 16 else dequantize_values(quant.v, g, dtype)
    kq = kq.permute(1, 0, 2, 3).reshape(H, G * g, D)
    vq = vq.permute(1, 0, 2, 3).reshape(H, G * g, D)
    k = torch.cat([kq, full.k.to(dtype)], dim=1)
    v = torch.cat([vq, full.v.to(dtype)], dim=1)
    return k, v, torch.cat([quant.positions.reshape(-1), full.positions])


def attend_visible(q: torch.Tensor, full: FullTokens, quant: QuantGroups | None, rope, view: ChunkView, *,
                   scale: float | None = None) -> AttentionResult:
    """Attention where ``view`` says, per query, which keys it sees and at what distance (the
    positions in ``full`` and ``quant`` are not read)."""
    T, Hq, D = q.shape
    k, v, _ = gather_keys_values(full, quant, q.dtype)
    Hkv = k.shape[0]
    qt = q.transpose(0, 1)
    qr = _rotate(rope, qt, view.q_positions)  # [Hq, T, D]
    kr = _rotate(rope, k, view.key_positions)  # [Hkv, L, D]
    if view.sink_keys is not None:
        # two frames in one product: [q at p, q at p_sink] · [k, 0] or [0, k_sink]
        sink = view.sink_keys[None, :, None]
        qr = torch.cat([qr, _rotate(rope, qt, view.q_sink_positions)], dim=-1)
        kr = torch.cat([kr.masked_fill(sink, 0), kr.masked_fill(~sink, 0)], dim=-1)
        v = torch.cat([v, torch.zeros_like(v)], dim=-1)  # equal head dims keep SDPA on its fused CPU path
    scale = scale if scale is not None else D ** -0.5
    out = F.scaled_dot_product_attention(qr.unsqueeze(0), kr.unsqueeze(0), v.unsqueeze(0), attn_mask=view.visible,
                                         scale=scale, enable_gqa=Hq != Hkv)[0]
    return AttentionResult(out[..., :D].transpose(0, 1))


def attend_reference(q: torch.Tensor, q_positions: torch.Tensor, full: FullTokens, quant: QuantGroups | None,
                     rope, *, scale: float | None = None, want_mass: bool = False, window: int | None = None,
                     sinks: int = 0) -> AttentionResult:
    """``window``: a layer that slides over its own window (the model's, not the policy's): a key
    is visible only when its position is within ``window`` of the query's (query - key < window),
    or it is one of the first ``sinks`` positions. None: every earlier key is visible."""
    T, Hq, D = q.shape
    k, v, k_pos = gather_keys_values(full, quant, q.dtype)
    Hkv = k.shape[0]
    qr = _rotate(rope, q.transpose(0, 1), q_positions)  # [Hq, T, D]
    kr = _rotate(rope, k, k_pos)  # [Hkv, L, D]
    visible = k_pos[None, :] <= q_positions[:, None]  # [T, L]
    if window is not None:
        visible &= (k_pos[None, :] > q_positions[:, None] - window) | (k_pos[None, :] < sinks)
    scale = scale if scale is not None else D ** -0.5
    if not want_mass:
        out = F.scaled_dot_product_attention(qr.unsqueeze(0), kr.unsqueeze(0), v.unsqueeze(0),
                                             attn_mask=visible, scale=scale, enable_gqa=Hq != Hkv)[0]
        return AttentionResult(out.transpose(0, 1))
    rep = Hq // Hkv
    kf = kr.float().repeat_interleave(rep, dim=0)
    vf = v.float().repeat_interleave(rep, dim=0)
    scores = torch.einsum("htd,hld->htl", qr.float(), kf) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out = torch.einsum("htl,hld->htd", probs, vf).to(q.dtype).transpose(0, 1)
    mass = probs.sum(dim=(0, 1))  # [L]
    n_quant = 0 if quant is None else quant.positions.numel()
    quant_mass = mass[:n_quant].reshape(quant.positions.shape) if n_quant else None
    return AttentionResult(out, mass[n_quant:], quant_mass)
