"""Host side of the split-K attention kernels: lays out queries and the two key segments,
picks the split count, launches partial → merge (→ mass) and reshapes the result.

Both public wrappers (``quant_attention.attend`` for the policy cache, ``paged_attention`` for
the full-precision block pool) describe their cache with the dataclasses below."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from localctx.kernels_cuda import attention_kernels as K

LOG2E = 1.4426950408889634
BLOCK_M = 16  # query rows per program (tl.dot needs at least 16)


@dataclass(frozen=True)
class Queries:
    q: torch.Tensor  # [B, T, n_heads, D], already rotated
    positions: torch.Tensor  # [B, T] in-cache positions


@dataclass(frozen=True)
class FullSegment:
    """Full-precision tokens: token j of sequence b is at block ``block_table[b, j // block_size]``,
    offset ``j % block_size``; ``k``/``v`` are indexed (block, token, head, channel) by the strides."""
    k: torch.Tensor
    v: torch.Tensor
    k_strides: tuple[int, int, int]  # block, token, head (channel stride must be 1)
    v_strides: tuple[int, int, int]
    block_table: torch.Tensor  # [B, n_blocks] int32
    block_size: int
    positions: torch.Tensor  # [B, L] (or [1, L] shared: batch stride 0) in-cache positions
    n_tokens: torch.Tensor  # [B] int32
    max_tokens: int  # host-side bound on n_tokens (sizes the grid; never read from the device)
    n_kv_heads: int


@dataclass(frozen=True)
class QuantSegment:
    """Quantized groups in the ``kvcache/quant.py`` layout, addressed through a group table."""
    k_codes: torch.Tensor  # [n_groups_pool, Hkv, g, D*bits/8] uint8
    k_scale: torch.Tensor  # [.., Hkv, 1, D] fp16
    k_min: torch.Tensor
    v_codes: torch.Tensor  # [.., Hkv, g, D*bits/8]
    v_scale: torch.Tensor  # [.., Hkv, g, D/g]
    v_min: torch.Tensor
    group_table: torch.Tensor  # [B, G] int32
    positions: torch.Tensor  # [B, G, g] in-cache positions
    n_groups: torch.Tensor  # [B] int32
    bits: int
    group_size: int


@dataclass(frozen=True)
class KeyMask:
    """Keys visible besides causality: the first ``sinks`` positions and the last ``window``
    (None: every earlier key)."""
    sinks: int = 0
    window: int | None = None


@dataclass(frozen=True)
class LaunchConfig:
    splits: int | None = None  # None: enough programs to fill the device
    block_n: int = 32  # full-precision keys per tile


def _splits(config: LaunchConfig, n_tiles: int, programs: int, device: torch.device) -> int:
    if config.splits is not None:
        return max(1, min(config.splits, max(n_tiles, 1)))
    if device.type != "cuda":
        return max(1, min(4, n_tiles))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_tiles, 64, math.ceil(2 * sms / max(programs, 1))))


def rope_table(inv_freq: torch.Tensor, device: torch.device) -> torch.Tensor:
    """fp32 [inv_freq | cos(off·f) | sin(off·f)] for off < ROPE_TILE, built in float64."""
    inv = inv_freq.to(device=device, dtype=torch.float64)
    angles = torch.outer(torch.arange(K.ROPE_TILE.value, device=device, dtype=torch.float64), inv)
    return torch.cat([inv, angles.cos().reshape(-1), angles.sin().reshape(-1)]).to(torch.float32)


def run_attention(queries: Queries, full: FullSegment, quant: QuantSegment | None, *,
                  inv_freq: torch.Tensor | None, scale: float, mask: KeyMask = KeyMask(),
                  want_mass: bool = False, config: LaunchConfig = LaunchConfig()
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns out [B, T, n_heads, D] (q's dtype) and, with ``want_mass``, the per-key mass
    [B, G*g + L] (quantized keys first, summed over all query heads and new tokens)."""
    q = queries.q
    B, T, Hq, D = q.shape
    Hkv = full.n_kv_heads
    rep = Hq // Hkv
    rows = T * rep
    dev = q.device
    qg = q.reshape(B, T, Hkv, rep, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, rows, D).contiguous()
    qpos = queries.positions.to(torch.int64).repeat_interleave(rep, dim=1).contiguous()
    g = quant.group_size if quant is not None else 16
    if max(g, config.block_n) > K.ROPE_TILE.value:
        raise ValueError(f"tiles of {max(g, config.block_n)} keys exceed the rope table ({K.ROPE_TILE.value})")
    max_groups = quant.group_table.shape[1] if quant is not None else 0
    n_tiles = max_groups + math.ceil(full.max_tokens / config.block_n)
    m_blocks = math.ceil(rows / BLOCK_M)
    splits = _splits(config, n_tiles, B * Hkv * m_blocks, dev)
    o_part = torch.empty((B, Hkv, splits, rows, D), dtype=torch.float32, device=dev)
    m_part = torch.empty((B, Hkv, splits, rows), dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    dummy = qpos  # stands in for the pointers of an absent segment (never read)
    qz = quant
    rope = rope_table(inv_freq, dev) if inv_freq is not None else dummy
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    window = mask.window or 0
    qk_scale = scale * LOG2E
    quant_args = ((qz.k_codes, qz.k_scale, qz.k_min, qz.v_codes, qz.v_scale, qz.v_min, qz.group_table,
                   qz.positions, qz.n_groups) if qz is not None else (dummy,) * 9)
    fpos_stride = full.positions.stride(0) if full.positions.shape[0] > 1 else 0
    common = dict(HEAD_DIM=D, GROUP=g, BITS=qz.bits if qz is not None else 8, HAS_QUANT=qz is not None,
                  ROPE=inv_freq is not None, PRECISION=precision)
    K.partial_kernel[(B * Hkv, m_blocks, splits)](
        qg, qpos, rope, *quant_args,
        full.k, full.v, full.block_table, full.positions, full.n_tokens,
        o_part, m_part, l_part,
        rows, Hkv, max_groups, full.block_size, full.block_table.shape[1], fpos_stride,
        *full.k_strides, *full.v_strides, qk_scale, mask.sinks, window,
        N_SPLITS=splits, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, **common)
    out = torch.empty((B, Hkv, rows, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, Hkv, rows), dtype=torch.float32, device=dev)
    K.merge_kernel[(B * Hkv, m_blocks)](o_part, m_part, l_part, out, lse, rows,
                                         N_SPLITS=splits, BLOCK_M=BLOCK_M, HEAD_DIM=D)
    result = out.reshape(B, Hkv, T, rep, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    if not want_mass:
        return result, None
    n_keys = max_groups * g + full.max_tokens
    mass = torch.zeros((B, Hkv, n_keys), dtype=torch.float32, device=dev)
    quant_key_args = quant_args[:3] + quant_args[6:] if qz is not None else (dummy,) * 6
    K.mass_kernel[(B * Hkv, n_tiles)](
        qg, qpos, lse, rope, *quant_key_args,
        full.k, full.block_table, full.positions, full.n_tokens, mass,
        rows, Hkv, max_groups, full.block_size, full.block_table.shape[1], fpos_stride, n_keys,
        *full.k_strides, qk_scale, mask.sinks, window,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, **common)
    return result, mass.sum(dim=1)
