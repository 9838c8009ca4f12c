"""The torch engine's side of the prompt cache on disk (``kvcache/prompt_cache.py``): the
conversation's sequence written in its own format (the paged cache's rotated fp16/fp32 K/V, or
the policy cache's stores: quantized codes and scales as held, window positions kept) and read
back memory-mapped into a fresh sequence."""
from __future__ import annotations

import numpy as np
import torch

from localctx.kvcache import prompt_cache
from localctx.kvcache.paged import PagedKVCache
from localctx.kvcache.policy_cache import PolicyKVCache
from localctx.kvcache.prompt_cache import CacheScope, Hit, PromptCache


def layout(cache: PagedKVCache | PolicyKVCache) -> str:
    s = cache.shape
    kind = "paged" if isinstance(cache, PagedKVCache) else "policy"
    return f"{kind}|{str(s.dtype).removeprefix('torch.')}|{s.n_layers}x{s.n_kv_heads}x{s.head_dim}"


def scope(model_hash: str, policy: str, cache) -> CacheScope:
    return CacheScope(model_hash=model_hash, backend="torch", policy=policy, layout=layout(cache))


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits travel as int16
        return t.view(torch.int16).numpy()
    return t.numpy()


def _to_torch(a: np.ndarray, like: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if like == torch.bfloat16 and t.dtype == torch.int16 else t


def save(store: PromptCache, cache, seq_id: int, tokens: list[int]) -> None:
    """Write the sequence's first ``len(tokens)`` tokens (the whole sequence for a policy cache)."""
    if isinstance(cache, PagedKVCache):
        tensors = cache.export_sequence(seq_id, len(tokens))
    else:
        tensors = cache.export_sequence(seq_id)
    store.save(tokens, {name: _to_numpy(t) for name, t in tensors.items()}, {"kv_bytes": str(cache.kv_bytes(seq_id))})


def lookup(store: PromptCache, cache, tokens: list[int], limit: int) -> Hit | None:
    """A paged cache can use any prefix of a file; a policy cache only a whole file."""
    return store.lookup(tokens, limit, whole_only=not isinstance(cache, PagedKVCache))


def save_point(cache, n_prompt: int, reused: int) -> int:
    """A paged cache saves all but the prompt's last token; a policy cache (quantized groups,
    windows: not cut back at any token) its last CHUNK boundary, to be used whole."""
    if isinstance(cache, PagedKVCache):
        return prompt_cache.exact_save_point(n_prompt, reused)
    return prompt_cache.save_point(n_prompt, reused)


def load(cache, seq_id: int, hit: Hit) -> None:
    """Make ``seq_id`` (not in the cache) hold the hit's first ``hit.n_tokens`` tokens."""
    dtype = cache.shape.dtype
    tensors = {name: _to_torch(a, dtype) for name, a in hit.file.tensors.items() if name != "tokens"}
    if isinstance(cache, PagedKVCache):
        tensors = {name: t[:, :hit.n_tokens] for name, t in tensors.items()}
    cache.import_sequence(seq_id, tensors)
