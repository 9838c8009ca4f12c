"""The block pool: bookkeeping for a preallocated KV store cut into fixed-size blocks.

Each live sequence owns a block table (the ids of its blocks, in order). A sequence that grows
takes blocks from the free list; nothing is copied. A sequence that finishes (or is truncated)
returns its blocks. The pool holds no tensors: caches (``kvcache/paged.py``) index their
tensors with the block ids it hands out, so the same bookkeeping serves every precision."""
from __future__ import annotations

from dataclasses import dataclass, field

from localctx.kvcache.errors import UserError


class PoolExhausted(UserError):
    """The pool has no free block left for a sequence that needs one."""


@dataclass
class SequenceBlocks:
    seq_id: int
    blocks: list[int] = field(default_factory=list)
    n_tokens: int = 0


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs at least one block of at least one token "
                             f"(got {n_blocks} blocks of {block_size})")
        self.n_blocks = n_blocks
        self.block_size = block_size
        # pop() from the end: low block ids are handed out first
        self._free: list[int] = list(range(n_blocks - 1, -1, -1))
        self._seqs: dict[int, SequenceBlocks] = {}

    # -- queries ---------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.n_blocks * self.block_size

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        return self._seq(seq_id).blocks

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).n_tokens

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_fit(self, extra_blocks: int) -> bool:
        return extra_blocks <= len(self._free)

    def slot(self, seq_id: int, position: int) -> tuple[int, int]:
        """(block id, offset in block) of the token at ``position`` in the sequence."""
        seq = self._seq(seq_id)
        if not 0 <= position < len(seq.blocks) * self.block_size:
            raise IndexError(f"position {position} is outside sequence {seq_id}'s blocks")
        return seq.blocks[position // self.block_size], position % self.block_size

    # -- life cycle --------------------------------------------------------------------------
    def admit(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the pool")
        self._seqs[seq_id] = SequenceBlocks(seq_id)

    def grow(self, seq_id: int, n_new: int) -> list[int]:
        """Make room for ``n_new`` more tokens; returns the blocks newly taken (maybe none)."""
        seq = self._seq(seq_id)
        if n_new < 0:
            raise ValueError("a sequence cannot grow by a negative number of tokens")
        need = self.blocks_for(seq.n_tokens + n_new) - len(seq.blocks)
        if need > len(self._free):
            raise PoolExhausted(
                f"the KV pool is full ({self.n_blocks} blocks of {self.block_size} tokens, "
                f"{len(self._free)} free, {need} needed); give a larger --context or a smaller batch")
        taken = [self._free.pop() for _ in range(max(0, need))]
        seq.blocks.extend(taken)
        seq.n_tokens += n_new
        return taken

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens of the sequence; blocks past them go back."""
        seq = self._seq(seq_id)
        if not 0 <= n_tokens <= seq.n_tokens:
            raise ValueError(f"cannot truncate sequence {seq_id} of {seq.n_tokens} tokens to {n_tokens}")
        keep = self.blocks_for(n_tokens)
        self._release(seq.blocks[keep:])
        del seq.blocks[keep:]
        seq.n_tokens = n_tokens

    def finish(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not in the pool")
        self._release(seq.blocks)

    def reset(self) -> None:
        for seq_id in list(self._seqs):
            self.finish(seq_id)

    # -- internals ---------------------------------------------------------------------------
    def _seq(self, seq_id: int) -> SequenceBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not in the pool")
        return seq

    def _release(self, blocks: list[int]) -> None:
        # hand blocks back so that the lowest ids are reused first
        self._free.extend(sorted(blocks, reverse=True))
        self._free.sort(reverse=True)
