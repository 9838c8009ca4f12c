"""The full-precision paged KV cache: K/V tensors for every layer, preallocated and cut into the
blocks a ``BlockPool`` hands out.

The seam with the model (kept identical for the quantized / evicting caches):

    cache.begin_step(seq_ids, n_new)          # which sequences run this forward, T new tokens each
    out = cache.attend(layer_idx, q, k, v)     # once per layer; q/k/v before RoPE
    cache.end_step()                           # (optional) the forward is over
    cache.abort_step()                         # instead, when the forward raised: the step is undone

q: [B, T, n_heads, head_dim]; k, v: [B, T, n_kv_heads, head_dim]; out: like q. The cache rotates
queries and keys at their positions *in the cache* with the model's ``Rotary``, appends K/V to
the sequences' blocks and runs ``paged_attention``. This cache never re-indexes positions (it
evicts nothing), so it stores keys already rotated: each key is rotated once, when written."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from localctx.kvcache.paged_attention import Rotary, paged_attention, run_attention
from localctx.kvcache.block_pool import BlockPool, PoolExhausted

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class CacheShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers (equals cost.full_bytes_per_token)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.elem_bytes

    @classmethod
    def for_tokens(cls, n_tokens: int, *, block_size: int = DEFAULT_BLOCK_SIZE, **kw) -> "CacheShape":
        return cls(n_blocks=max(1, -(-n_tokens // block_size)), block_size=block_size, **kw)


@dataclass
class StepLayout:
    """Where the new tokens of one forward go, computed once and shared by all layers."""
    seq_ids: tuple[int, ...]
    n_new: int
    q_positions: torch.Tensor  # [B, T] in-cache positions of the new tokens
    slots: torch.Tensor  # [B*T] flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, n] padded with block 0 (masked out by position)
    contiguous_from: int | None  # one sequence whose blocks are consecutive: first block id
    runs: list[tuple[int, int]] | None  # every sequence's blocks consecutive: (first block, tokens held)


class PagedKVCache:
    def __init__(self, shape: CacheShape, rope: Rotary, *, attention=paged_attention):
        self.shape = shape
        self.rope = rope
        self.attention = attention  # same signature as paged_attention (a fused kernel may replace it)
        self.pool = BlockPool(shape.n_blocks, shape.block_size)
        dims = (shape.n_layers, shape.n_blocks, shape.block_size, shape.n_kv_heads, shape.head_dim)
        self.k = torch.zeros(dims, dtype=shape.dtype, device=shape.device)
        self.v = torch.zeros(dims, dtype=shape.dtype, device=shape.device)
        self.step: StepLayout | None = None
        self._lengths_before_step: dict[int, int] = {}

    # -- sequences ---------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, reserve_tokens: int = 0) -> None:
        """``reserve_tokens``: blocks for that many tokens are set aside now, contiguous where
        possible (a batch admits each sequence with room for its prompt and answer)."""
        self.pool.admit(seq_id, reserve_tokens)

    def finish(self, seq_id: int) -> None:
        self.pool.finish(seq_id)

    def can_truncate(self, seq_id: int, n_tokens: int) -> bool:
        """Any prefix can be kept (the policy cache answers this per policy)."""
        return 0 <= n_tokens <= self.pool.length(seq_id)

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Forget every token of the sequence after the first ``n_tokens`` (a conversation that
        diverged from what is cached keeps only the common prefix)."""
        self.pool.truncate(seq_id, n_tokens)

    def append_room(self, seq_id: int, limit: int = 64) -> int:
        """Tokens the next step can append and ``drop_newest`` undo exactly: any (up to ``limit``),
        since nothing here is quantized or evicted."""
        return limit

    def drop_newest(self, seq_id: int, n_tokens: int) -> None:
        """Forget the last ``n_tokens`` of the sequence (speculative decoding's rollback)."""
        self.truncate(seq_id, self.pool.length(seq_id) - n_tokens)

    # -- the prompt cache on disk (kvcache/prompt_cache.py) -----------------------------------
    def export_sequence(self, seq_id: int, n_tokens: int) -> dict[str, torch.Tensor]:
        """The first ``n_tokens`` of the sequence as {"k", "v"}: [n_layers, n, n_kv_heads, head_dim]
        each, keys rotated as stored."""
        s = self.shape
        blocks = torch.tensor(self.pool.block_table(seq_id)[:self.pool.blocks_for(n_tokens)], device=s.device)
        flat = (s.n_layers, -1, s.n_kv_heads, s.head_dim)
        return {"k": self.k[:, blocks].reshape(flat)[:, :n_tokens], "v": self.v[:, blocks].reshape(flat)[:, :n_tokens]}

    def import_sequence(self, seq_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """A new sequence holding what ``export_sequence`` gave (its token count from the tensors)."""
        k, v = tensors["k"], tensors["v"]
        n = k.shape[1]
        self.pool.admit(seq_id, n)
        self.pool.grow(seq_id, n)
        bs, s = self.shape.block_size, self.shape
        table = torch.tensor(self.pool.block_table(seq_id), dtype=torch.long, device=s.device)
        pos = torch.arange(n, device=s.device)
        slots = table[pos // bs] * bs + pos % bs
        flat = (-1, s.n_kv_heads, s.head_dim)
        for layer in range(s.n_layers):
            self.k[layer].view(flat).index_copy_(0, slots, k[layer].to(device=s.device, dtype=s.dtype))
            self.v[layer].view(flat).index_copy_(0, slots, v[layer].to(device=s.device, dtype=s.dtype))

    def reset(self) -> None:
        self.pool.reset()

    def length(self, seq_id: int) -> int:
        return self.pool.length(seq_id)

    def has(self, seq_id: int) -> bool:
        return self.pool.has(seq_id)

    def can_admit(self, n_tokens: int) -> bool:
        """Whether a new sequence of up to ``n_tokens`` tokens fits in the free blocks."""
        return self.pool.can_fit(self.pool.blocks_for(n_tokens))

    # -- accounting (equals kvcache.cost for the same policy and token count) -----------------
    def kv_bytes(self, seq_id: int | None = None) -> int:
        """Bytes of the K/V the cache holds for one sequence, or all of them."""
        ids = self.pool.sequences() if seq_id is None else [seq_id]
        return sum(self.pool.length(s) for s in ids) * self.shape.bytes_per_token

    def reserved_bytes(self, seq_id: int | None = None) -> int:
        """Bytes of the blocks in the sequences' block tables (tokens rounded up to whole blocks;
        blocks only set aside by ``add_sequence(reserve_tokens=...)`` are not counted)."""
        if seq_id is None:
            blocks = self.pool.used_blocks
        else:
            blocks = len(self.pool.block_table(seq_id))
        return blocks * self.shape.block_size * self.shape.bytes_per_token

    def pool_bytes(self) -> int:
        """Bytes preallocated for the whole pool (what the process holds)."""
        return self.k.numel() * self.k.element_size() * 2

    def kv_tokens(self, seq_id: int | None = None) -> int:
        ids = self.pool.sequences() if seq_id is None else [seq_id]
        return sum(self.pool.length(s) for s in ids)

    # -- the forward seam --------------------------------------------------------------------
    def begin_step(self, seq_ids: Sequence[int], n_new: int | Sequence[int]) -> None:
        """Reserve room for ``n_new`` new tokens in each sequence (all the same count: chunked
        prefill is one sequence with T tokens, batched decode B sequences with 1 each)."""
        counts = [n_new] * len(seq_ids) if isinstance(n_new, int) else list(n_new)
        if len(set(counts)) != 1 or counts[0] < 1:
            raise ValueError(f"every sequence in a step must add the same positive number of tokens, got {counts}")
        T = counts[0]
        pool = self.pool
        need = sum(pool.free_blocks_needed(s, T) for s in seq_ids)
        if not pool.can_fit(need):
            raise PoolExhausted(f"the KV pool is full ({pool.n_blocks} blocks of {pool.block_size} tokens, "
                                f"{pool.free_blocks} free, {need} needed); give a larger --context or a smaller batch")
        starts = [pool.length(s) for s in seq_ids]
        for s in seq_ids:
            pool.grow(s, T)
        self._lengths_before_step = dict(zip(seq_ids, starts))
        self.step = self._layout(tuple(seq_ids), T, starts)

    def _layout(self, seq_ids: tuple[int, ...], T: int, starts: list[int]) -> StepLayout:
        bs = self.shape.block_size
        dev = self.shape.device
        tables = [self.pool.block_table(s) for s in seq_ids]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        block_tables = torch.tensor(padded, dtype=torch.long, device=dev)
        offsets = torch.arange(T, device=dev)
        q_positions = torch.tensor(starts, dtype=torch.long, device=dev)[:, None] + offsets[None, :]
        slots = (block_tables.gather(1, q_positions // bs) * bs + q_positions % bs).reshape(-1)
        consecutive = all(t == list(range(t[0], t[0] + len(t))) for t in tables)
        runs = [(t[0], start + T) for t, start in zip(tables, starts)] if consecutive else None
        contiguous = tables[0][0] if consecutive and len(seq_ids) == 1 else None
        return StepLayout(seq_ids, T, q_positions, slots, block_tables, contiguous, runs)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step is None:
            raise RuntimeError("attend() called outside a step: call begin_step(seq_ids, n_new) first")
        B, T, _, _ = q.shape
        if B != len(step.seq_ids) or T != step.n_new:
            raise ValueError(f"attend got [B={B}, T={T}] but the step has {len(step.seq_ids)} sequences "
                             f"of {step.n_new} new tokens")
        n_heads = q.shape[2]
        qk = self.rope.rotate(torch.cat([q, k], dim=2), step.q_positions)  # one rotation for both
        q, k = qk[:, :, :n_heads], qk[:, :, n_heads:]
        kl = self.k[layer_idx]
        vl = self.v[layer_idx]
        flat = (-1, self.shape.n_kv_heads, self.shape.head_dim)
        kl.view(flat).index_copy_(0, step.slots, k.reshape(flat).to(kl.dtype))
        vl.view(flat).index_copy_(0, step.slots, v.reshape(flat).to(vl.dtype))
        if step.runs is not None and len(step.seq_ids) > 1 and T == 1 and self.attention is paged_attention:
            return run_attention(q, kl, vl, step.runs)  # the reference's fast path for batched decode
        return self.attention(q, kl, vl, step.block_tables, step.q_positions,
                               contiguous_from=step.contiguous_from)

    def end_step(self) -> None:
        self.step = None

    def abort_step(self) -> None:
        """Undo the step in progress: each sequence back to its length before ``begin_step`` (the
        rows some layers already wrote lie past it and are written again by the next step)."""
        if self.step is not None:
            for seq_id, length in self._lengths_before_step.items():
                if self.pool.has(seq_id):
                    self.pool.truncate(seq_id, length)
        self.step = None
