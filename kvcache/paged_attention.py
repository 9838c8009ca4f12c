"""Paged attention: the pure-torch reference every fused kernel (CUDA, Metal) replaces behind
the same signature.

Keys sit in blocks of a pool (``k_blocks``: [n_blocks, block_size, n_kv_heads, head_dim]).
A sequence's keys are its blocks in block-table order; the key at index ``j`` of that list is
at position ``j`` *in the cache* (docs/architecture.md "KV policies"), and a query at position ``p`` sees
keys ``0..p``. Keys are stored either already rotated at their in-cache position
(``key_rope=None``) or before RoPE, in which case ``key_rope`` rotates them here."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Rotary(Protocol):
    """RoPE as the model defines it (base, scaling); the cache calls it, the model builds it."""

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x``: [B, T, H, D]; ``positions``: [B, T] integer positions. Returns x rotated."""
        ...


def gather_blocks(blocks: torch.Tensor, block_tables: torch.Tensor, contiguous_from: int | None = None
                  ) -> torch.Tensor:
    """[n_blocks, bs, H, D] + [B, n] block ids → [B, n*bs, H, D].

    ``contiguous_from``: when the batch is one sequence whose blocks are the consecutive ids
    ``contiguous_from .. contiguous_from+n-1``, the result is a view (no copy)."""
    B, n = block_tables.shape
    _, bs, H, D = blocks.shape
    if contiguous_from is not None and B == 1:
        return blocks[contiguous_from:contiguous_from + n].reshape(1, n * bs, H, D)
    return blocks.index_select(0, block_tables.reshape(-1)).reshape(B, n * bs, H, D)


def causal_mask(q_positions: torch.Tensor, n_keys: int, sinks: int = 0, window: int | None = None
                ) -> torch.Tensor:
    """[B, 1, T, L] bool: key j is visible to the query at position p iff j <= p (and, with a
    ``window``, j < ``sinks`` or j > p - ``window``: sinks + sliding window by masking)."""
    keys = torch.arange(n_keys, device=q_positions.device)[None, None, :]
    visible = keys <= q_positions[:, :, None]
    if window is not None:
        visible &= (keys < sinks) | (keys > q_positions[:, :, None] - window)
    return visible[:, None]


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                    block_tables: torch.Tensor, q_positions: torch.Tensor, *,
                    key_rope: Rotary | None = None, scale: float | None = None,
                    contiguous_from: int | None = None, sinks: int = 0, window: int | None = None
                    ) -> torch.Tensor:
    """Causal grouped-query attention over paged K/V (``sinks``/``window``: see ``causal_mask``).

    q: [B, T, n_heads, D], already rotated at ``q_positions`` ([B, T]); the new tokens' K/V
    are already written into the blocks. Returns [B, T, n_heads, D]."""
    B, T, H, D = q.shape
    k = gather_blocks(k_blocks, block_tables, contiguous_from)
    v = gather_blocks(v_blocks, block_tables, contiguous_from)
    L = k.shape[1]
    if key_rope is not None:
        pos = torch.arange(L, device=q.device).expand(B, L)
        k = key_rope.rotate(k, pos)
    mask = causal_mask(q_positions, L, sinks, window)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=H != k.shape[2])
    return out.transpose(1, 2)


def run_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                  runs: list[tuple[int, int]], scale: float | None = None) -> torch.Tensor:
    """Batched decode (T = 1) when every sequence's blocks are consecutive ids: each sequence
    attends over a view of its own run of blocks, so no K/V is gathered or copied.

    With one query token every key is visible, so the ``H / Hkv`` query heads that share a KV head
    are passed to SDPA as that head's query rows: one call per KV head's keys, with no GQA expansion
    of K/V (SDPA's ``enable_gqa`` copies them on CPU, about half the step's attention time at 8K).

    runs: per sequence (first block id, tokens held including the new one). Returns [B, 1, H, D]."""
    B, T, H, D = q.shape
    _, bs, Hkv, _ = k_blocks.shape
    if T != 1:
        raise ValueError(f"run_attention is the decode path (one token per sequence), got {T} tokens")
    rep = H // Hkv
    out = torch.empty_like(q)
    for b, (first, n_tokens) in enumerate(runs):
        n_blocks = -(-n_tokens // bs)
        k = k_blocks[first:first + n_blocks].reshape(n_blocks * bs, Hkv, D)[:n_tokens]
        v = v_blocks[first:first + n_blocks].reshape(n_blocks * bs, Hkv, D)[:n_tokens]
        rows = q[b, 0].reshape(1, Hkv, rep, D)  # query head h = kv head h // rep, row h % rep
        o = F.scaled_dot_product_attention(rows, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale)
        out[b, 0] = o.reshape(H, D)
    return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """The same attention without blocks, written out in plain matmuls: the tests' reference.

    q: [B, T, H, D]; k, v: [B, L, Hkv, D] (rotated); q_positions: [B, T]."""
    B, T, H, D = q.shape
    group = H // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,blhd->bhtl", q.float(), k.float()) * (scale or D ** -0.5)
    scores = scores.masked_fill(~causal_mask(q_positions, k.shape[1]), float("-inf"))
    return torch.einsum("bhtl,blhd->bthd", scores.softmax(-1), v.float()).to(q.dtype)
