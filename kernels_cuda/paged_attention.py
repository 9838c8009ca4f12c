"""The fused replacement of ``kvcache.attention.paged_attention`` (attention over the
full-precision block pool), with the same signature: split-K decode over the blocks a block
table names, grouped-query attention, optional sinks + window masking and optional RoPE of
pre-RoPE keys at their in-cache positions (``key_rope`` must then expose ``inv_freq``).

``reference`` is the kvcache function itself, not a copy."""
from __future__ import annotations

import torch

from localctx.kernels_cuda.launch import FullSegment, KeyMask, LaunchConfig, Queries, run_attention
from localctx.kvcache.paged_attention import paged_attention as reference

__all__ = ["paged_attention", "reference"]


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                    block_tables: torch.Tensor, q_positions: torch.Tensor, *,
                    key_rope=None, scale: float | None = None, contiguous_from: int | None = None,
                    sinks: int = 0, window: int | None = None,
                    config: LaunchConfig = LaunchConfig()) -> torch.Tensor:
    """q: [B, T, n_heads, D] rotated; k/v_blocks: [n_blocks, block_size, n_kv_heads, D];
    block_tables: [B, n]; q_positions: [B, T]. Returns [B, T, n_heads, D].

    ``contiguous_from`` is accepted for signature parity (the reference's no-copy gather);
    the kernel reads blocks in place either way."""
    del contiguous_from
    B, T, Hq, D = q.shape
    n_blocks, bs, Hkv, _ = k_blocks.shape
    dev = q.device
    n_keys = block_tables.shape[1] * bs
    k = k_blocks.to(q.dtype)
    v = v_blocks.to(q.dtype)
    # keys past the newest query are invisible: the kernel never reads them
    n_tokens = (q_positions.max(dim=1).values + 1).clamp(max=n_keys).to(torch.int32)
    full = FullSegment(k=k, v=v, k_strides=tuple(k.stride()[:3]), v_strides=tuple(v.stride()[:3]),
                       block_table=block_tables.to(torch.int32).contiguous(), block_size=bs,
                       positions=torch.arange(n_keys, device=dev).reshape(1, n_keys),
                       n_tokens=n_tokens, max_tokens=n_keys, n_kv_heads=Hkv)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("paged_attention needs K/V blocks whose channel axis is contiguous")
    inv_freq = key_rope.inv_freq if key_rope is not None else None
    out, _ = run_attention(Queries(q, q_positions), full, None, inv_freq=inv_freq,
                           scale=scale if scale is not None else D ** -0.5,
                           mask=KeyMask(sinks, window), config=config)
    return out
