"""Quantise-and-append: whole groups of new K/V → 4/8-bit codes with fp16 scale and min,
written into the slots of a quantized block pool, in the ``kvcache/quant.py`` layout (keys per
channel over the group's tokens, values per token over ``g`` channels, 4-bit codes two per byte,
even channel in the low nibble). One Triton program quantizes one (group, KV head).

``quantize_append_reference`` does the same with kvcache's ``quantize_keys`` /
``quantize_values``; the kernel reproduces them bit for bit (fp16-rounded min and scale,
correctly rounded division, round half to even)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from localctx.kvcache import quant


@dataclass(frozen=True)
class QuantPool:
    """Destination tensors; axis 0 is the slot (one group of g tokens of one layer)."""
    k_codes: torch.Tensor  # [S, H, g, D*bits/8] uint8
    k_scale: torch.Tensor  # [S, H, 1, D] fp16
    k_min: torch.Tensor
    v_codes: torch.Tensor  # [S, H, g, D*bits/8] uint8
    v_scale: torch.Tensor  # [S, H, g, D/g] fp16
    v_min: torch.Tensor

    @classmethod
    def empty(cls, n_slots: int, n_heads: int, head_dim: int, bits: int, group_size: int,
              device: str | torch.device = "cpu") -> "QuantPool":
        quant.check_bits(bits)
        g, D, dt = group_size, head_dim, quant.SCALE_DTYPE
        codes = lambda: torch.zeros((n_slots, n_heads, g, D * bits // 8), dtype=torch.uint8, device=device)
        return cls(codes(), torch.zeros((n_slots, n_heads, 1, D), dtype=dt, device=device),
                   torch.zeros((n_slots, n_heads, 1, D), dtype=dt, device=device), codes(),
                   torch.zeros((n_slots, n_heads, g, D // g), dtype=dt, device=device),
                   torch.zeros((n_slots, n_heads, g, D // g), dtype=dt, device=device))

    def keys(self, bits: int) -> quant.QuantizedTensor:
        return quant.QuantizedTensor(self.k_codes, self.k_scale, self.k_min, bits)

    def values(self, bits: int) -> quant.QuantizedTensor:
        return quant.QuantizedTensor(self.v_codes, self.v_scale, self.v_min, bits)


def quantize_append_reference(k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int,
                              pool: QuantPool, slots: torch.Tensor) -> None:
    """k, v: [G, H, g, D] (keys before RoPE); writes group i into ``pool`` slot ``slots[i]``."""
    for i, slot in enumerate(slots.tolist()):
        qk = quant.quantize_keys(k[i], bits)
        qv = quant.quantize_values(v[i], bits, group_size)
        for dst, src in ((pool.k_codes, qk.codes), (pool.k_scale, qk.scale), (pool.k_min, qk.min),
                         (pool.v_codes, qv.codes), (pool.v_scale, qv.scale), (pool.v_min, qv.min)):
            dst[slot] = src


@triton.jit
def _rint(x):
    """Round half to even, as torch.round (exact for |x| < 2**23)."""
    r = tl.floor(x)
    d = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def _affine(x, lo, hi, LEVELS: tl.constexpr):
    """codes (fp32), fp16 scale and fp16 min of values ``x`` whose group min/max are lo/hi."""
    mn = lo.to(tl.float16)
    mnf = mn.to(tl.float32)
    scale = tl.math.div_rn(hi - mnf, tl.full(hi.shape, LEVELS, tl.float32)).to(tl.float16)
    s = scale.to(tl.float32)
    safe = tl.where(s > 0, s, 1.0)
    codes = tl.math.div_rn(x - mnf, safe)
    return tl.minimum(tl.maximum(_rint(codes), 0.0), LEVELS), scale, mn


@triton.jit
def _store_codes(codes_ptr, row_off, pair, even, odd, BITS: tl.constexpr):
    """even/odd: codes of channels 2*pair and 2*pair+1 for the rows at ``row_off`` (bytes)."""
    if BITS == 4:
        packed = even.to(tl.int32) | (odd.to(tl.int32) << 4)
        tl.store(codes_ptr + row_off + pair, packed.to(tl.uint8))
    else:
        tl.store(codes_ptr + row_off + 2 * pair, even.to(tl.uint8))
        tl.store(codes_ptr + row_off + 2 * pair + 1, odd.to(tl.uint8))


@triton.jit
def quant_keys_kernel(x_ptr, slot_ptr, codes_ptr, scale_ptr, min_ptr, n_heads, sx_g, sx_h, sx_t,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    LEVELS: tl.constexpr = (1 << BITS) - 1
    PACKED: tl.constexpr = HEAD_DIM * BITS // 8
    pid = tl.program_id(0)
    gi = pid // n_heads
    h = pid % n_heads
    j = tl.arange(0, HEAD_DIM // 2)
    tok = tl.arange(0, GROUP)
    base = x_ptr + gi.to(tl.int64) * sx_g + h * sx_h + tok[:, None] * sx_t
    xe = tl.load(base + 2 * j[None, :]).to(tl.float32)
    xo = tl.load(base + 2 * j[None, :] + 1).to(tl.float32)
    ce, se, me = _affine(xe, tl.min(xe, 0, keep_dims=True), tl.max(xe, 0, keep_dims=True), LEVELS)
    co, so, mo = _affine(xo, tl.min(xo, 0, keep_dims=True), tl.max(xo, 0, keep_dims=True), LEVELS)
    dh = tl.load(slot_ptr + gi).to(tl.int64) * n_heads + h
    sc = dh * HEAD_DIM + 2 * j[None, :]
    tl.store(scale_ptr + sc, se)
    tl.store(scale_ptr + sc + 1, so)
    tl.store(min_ptr + sc, me)
    tl.store(min_ptr + sc + 1, mo)
    _store_codes(codes_ptr, ((dh * GROUP + tok) * PACKED)[:, None], j[None, :], ce, co, BITS)


@triton.jit
def quant_values_kernel(x_ptr, slot_ptr, codes_ptr, scale_ptr, min_ptr, n_heads, sx_g, sx_h, sx_t,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    LEVELS: tl.constexpr = (1 << BITS) - 1
    PACKED: tl.constexpr = HEAD_DIM * BITS // 8
    NG: tl.constexpr = HEAD_DIM // GROUP
    pid = tl.program_id(0)
    gi = pid // n_heads
    h = pid % n_heads
    tok = tl.arange(0, GROUP)[:, None, None]
    grp = tl.arange(0, NG)[None, :, None]
    k = tl.arange(0, GROUP // 2)[None, None, :]
    ch = grp * GROUP + 2 * k  # even channels, [1, NG, g/2]
    base = x_ptr + gi.to(tl.int64) * sx_g + h * sx_h + tok * sx_t
    xe = tl.load(base + ch).to(tl.float32)
    xo = tl.load(base + ch + 1).to(tl.float32)
    lo = tl.minimum(tl.min(xe, 2, keep_dims=True), tl.min(xo, 2, keep_dims=True))
    hi = tl.maximum(tl.max(xe, 2, keep_dims=True), tl.max(xo, 2, keep_dims=True))
    ce, scale, mn = _affine(xe, lo, hi, LEVELS)
    co, _, _ = _affine(xo, lo, hi, LEVELS)
    dh = tl.load(slot_ptr + gi).to(tl.int64) * n_heads + h
    sc = (dh * GROUP + tok) * NG + grp
    tl.store(scale_ptr + sc, scale)
    tl.store(min_ptr + sc, mn)
    _store_codes(codes_ptr, (dh * GROUP + tok) * PACKED, grp * (GROUP // 2) + k, ce, co, BITS)


def num_warps(head_dim: int, group_size: int) -> int:
    """Eight warps once a group holds 8,192 elements (head dim 256 × 32 tokens, 128 × 64): with four,
    the keys kernel at head dim 256, groups of 64, spills (benchmarks/cuda_check/compile.py)."""
    return 8 if head_dim * group_size >= 8192 else 4


def quantize_append(k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int,
                    pool: QuantPool, slots: torch.Tensor) -> None:
    """Same contract as ``quantize_append_reference`` (the pool tensors must be contiguous)."""
    quant.check_bits(bits)
    G, H, g, D = k.shape
    if g != group_size or D % group_size or v.shape != k.shape:
        raise ValueError(f"quantize_append takes whole groups: k, v of [G, H, {group_size}, D] with D a multiple of "
                         f"{group_size}; got {tuple(k.shape)} and {tuple(v.shape)}")
    if G == 0:
        return
    slots32 = slots.to(device=k.device, dtype=torch.int32).contiguous()
    for x, kernel, dst in ((k, quant_keys_kernel, (pool.k_codes, pool.k_scale, pool.k_min)),
                           (v, quant_values_kernel, (pool.v_codes, pool.v_scale, pool.v_min))):
        x = x if x.stride(-1) == 1 else x.contiguous()
        kernel[(G * H,)](x, slots32, *dst, H, x.stride(0), x.stride(1), x.stride(2),
                         GROUP=g, HEAD_DIM=D, BITS=bits, num_warps=num_warps(D, g))


def quantize_groups(k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int
                    ) -> tuple[quant.QuantizedTensor, quant.QuantizedTensor]:
    """k, v: [G, H, g, D] → (keys, values) stacked over the G groups, as ``kvcache.quant`` lays
    them out (what ``LayerStore.age`` appends)."""
    G, H, _, D = k.shape
    pool = QuantPool.empty(G, H, D, bits, group_size, k.device)
    quantize_append(k, v, bits, group_size, pool, torch.arange(G, device=k.device))
    return pool.keys(bits), pool.values(bits)
