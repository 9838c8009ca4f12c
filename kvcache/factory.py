"""Build the KV cache a policy needs: the full-precision paged cache for an exact policy on a model
whose layers all attend over everything (keys stored rotated, nothing to re-index), the policy
cache for everything else — including a model with sliding layers of its own (``layer_windows``),
whose sliding layers then hold only their window."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from localctx.kvcache.paged_attention import paged_attention
from localctx.kvcache.quant_attention import attend_reference
from localctx.kvcache.paged import DEFAULT_BLOCK_SIZE, CacheShape, PagedKVCache
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache


@dataclass(frozen=True)
class CacheRequest:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    capacity_tokens: int  # tokens the pool holds across all sequences
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    block_size: int = DEFAULT_BLOCK_SIZE
    # the model's own sliding window per layer (None: full attention); empty: every layer is full
    layer_windows: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class CacheKernels:
    """Implementations with the references' signatures (a backend passes fused kernels here)."""
    paged_attention: Callable = paged_attention
    policy_attention: Callable = attend_reference
    quantize_groups: Callable | None = None  # None: the reference quantizer, all aged groups at once


def make_kv_cache(policy: KVPolicy, req: CacheRequest, rope,
                  kernels: CacheKernels = CacheKernels()) -> PagedKVCache | PolicyKVCache:
    """``rope``: the model's Rotary, or a list of one per layer (layers with different bases)."""
    per_layer = isinstance(rope, (list, tuple)) or any(w is not None for w in req.layer_windows)
    if policy.exact and not per_layer:
        shape = CacheShape.for_tokens(req.capacity_tokens, block_size=req.block_size, n_layers=req.n_layers,
                                      n_kv_heads=req.n_kv_heads, head_dim=req.head_dim, dtype=req.dtype,
                                      device=req.device)
        return PagedKVCache(shape, rope, attention=kernels.paged_attention)
    shape = PolicyCacheShape(req.n_layers, req.n_kv_heads, req.head_dim, req.dtype, req.device,
                             capacity_tokens=req.capacity_tokens, block_size=req.block_size)
    return PolicyKVCache(shape, policy, rope, attention=kernels.policy_attention,
                         quantize_groups=kernels.quantize_groups, layer_windows=req.layer_windows)
