"""Group-wise affine quantization of K/V (8- and 4-bit), as docs/architecture.md "KV policies" defines it.

One group of ``group_size`` elements shares a ``scale`` and a ``min`` (both fp16):

    code = round((x - min) / scale)          in [0, 2**bits - 1]
    x̂    = code * scale + min

The codes are computed against the fp16-rounded scale and min, so ``dequantize`` reproduces
exactly what ``quantize`` measured its error against.

Layout of one quantized group of ``g`` tokens (one layer, one sequence; H = KV heads, D = head dim):

- keys, grouped **per channel** over the group's g tokens (KIVI: key outliers are per channel)
    ``k_codes`` uint8 [H, g, D * bits / 8]   ``k_scale``, ``k_min`` fp16 [H, 1, D]
- values, grouped **per token** over g consecutive channels
    ``v_codes`` uint8 [H, g, D * bits / 8]   ``v_scale``, ``v_min`` fp16 [H, g, D / g]

4-bit codes are packed two to a byte along the channel axis: channel 2i in the low nibble,
channel 2i+1 in the high nibble. 8-bit codes are one byte each. Keys are quantized before RoPE.

Keys and values each have their own bits (a policy such as ``k8v4``); a side at 16 bits
(``kf16v4``'s keys) is held as the group's rows in the model's dtype (``FullGroups``), no scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from localctx.kvcache.errors import UserError

SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes (packed when 4-bit) with the scale and min of each group, broadcastable to the
    unpacked codes along the grouped axis."""
    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    bits: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min))


@dataclass(frozen=True)
class FullGroups:
    """One side of quantized groups held at full precision (kf16v4's keys): ``data`` [..., H, g, D]
    in the model's dtype, no scales."""
    data: torch.Tensor
    bits: int = 16

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"quantized KV is 4- or 8-bit, got {bits}")


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], last axis even → two per byte (even index in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit packing needs an even last axis, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _affine(x: torch.Tensor, bits: int, dim: int) -> QuantizedTensor:
    """Quantize ``x`` with one group per slice along ``dim`` (the whole axis is the group)."""
    check_bits(bits)
    levels = (1 << bits) - 1
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    mn = lo.to(SCALE_DTYPE)
    scale = ((hi - mn.float()) / levels).to(SCALE_DTYPE)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((xf - mn.float()) / safe).clamp_(0, levels).to(torch.uint8)
    return QuantizedTensor(codes, scale, mn, bits)


def _codes(q: QuantizedTensor) -> torch.Tensor:
    return unpack4(q.codes) if q.bits == 4 else q.codes


def _pack(q: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor(pack4(q.codes), q.scale, q.min, q.bits) if q.bits == 4 else q


def quantize_keys(k: torch.Tensor, bits: int) -> QuantizedTensor:
    """k: [..., H, g, D] (groups of g tokens, before RoPE) → per-channel groups over the g tokens.
    Returns codes [..., H, g, D*bits/8], scale/min [..., H, 1, D]."""
    return _pack(_affine(k, bits, dim=-2))


def dequantize_keys(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """→ [..., H, g, D]; works on stacked groups ([G, H, g, ...]) too."""
    return (_codes(q).float() * q.scale.float() + q.min.float()).to(dtype)


def quantize_values(v: torch.Tensor, bits: int, group_size: int) -> QuantizedTensor:
    """v: [..., H, g, D] → per-token groups of ``group_size`` channels.
    Returns codes [..., H, g, D*bits/8], scale/min [..., H, g, D/group_size]."""
    lead, D = v.shape[:-1], v.shape[-1]
    if D % group_size:
        raise UserError(f"head dim {D} is not a multiple of the quantization group size {group_size}; "
                        "use --kv with g32, or full precision")
    q = _affine(v.reshape(*lead, D // group_size, group_size), bits, dim=-1)
    codes = q.codes.reshape(*lead, D)
    return _pack(QuantizedTensor(codes, q.scale.squeeze(-1), q.min.squeeze(-1), bits))


def dequantize_values(q: QuantizedTensor, group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """→ [..., H, g, D]; works on stacked groups ([G, H, g, ...]) too."""
    codes = _codes(q).float()
    lead, D = codes.shape[:-1], codes.shape[-1]
    grouped = codes.reshape(*lead, D // group_size, group_size)
    out = grouped * q.scale.float().unsqueeze(-1) + q.min.float().unsqueeze(-1)
    return out.reshape(*lead, D).to(dtype)


def group_bytes(n_kv_heads: int, head_dim: int, bits: int, group_size: int) -> int:
    """Bytes one quantized group of ``group_size`` tokens takes in one layer (K and V, with the
    fp16 scale and min of every group); equals ``cost.quant_bytes_per_token`` / layers × g."""
    payload = 2 * n_kv_heads * group_size * head_dim * bits // 8
    k_scales = 2 * n_kv_heads * head_dim  # scale + min per channel
    v_scales = 2 * n_kv_heads * group_size * (head_dim // group_size)  # scale + min per token group
    return payload + (k_scales + v_scales) * torch.finfo(SCALE_DTYPE).bits // 8
