"""Build the KV cache a policy needs: the full-precision paged cache for an exact policy (keys
stored rotated, nothing to re-index), the policy cache for everything else."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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


def make_kv_cache(policy: KVPolicy, req: CacheRequest, rope) -> PagedKVCache | PolicyKVCache:
    if policy.exact:
        shape = CacheShape.for_tokens(req.capacity_tokens, block_size=req.block_size, n_layers=req.n_layers,
                                      n_kv_heads=req.n_kv_heads, head_dim=req.head_dim, dtype=req.dtype,
                                      device=req.device)
        return PagedKVCache(shape, rope)
    shape = PolicyCacheShape(req.n_layers, req.n_kv_heads, req.head_dim, req.dtype, req.device,
                             capacity_tokens=req.capacity_tokens, block_size=req.block_size)
    return PolicyKVCache(shape, policy, rope)
