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
    reserved: list[int] = field(default_factory=list)  # set aside for this sequence, taken first as it grows


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
        """Blocks in some sequence's block table."""
        return sum(len(s.blocks) for s in self._seqs.values())

    @property
    def reserved_blocks(self) -> int:
        """Blocks set aside for sequences but not yet in their tables."""
        return sum(len(s.reserved) for s in self._seqs.values())

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

    def reserved_for(self, seq_id: int) -> int:
        """Blocks set aside for the sequence and not yet in its table."""
        return len(self._seq(seq_id).reserved)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_fit(self, extra_blocks: int) -> bool:
        return extra_blocks <= len(self._free)

    def free_blocks_needed(self, seq_id: int, n_new: int) -> int:
        """Blocks that growing the sequence by ``n_new`` tokens takes from the free list."""
        seq = self._seq(seq_id)
        need = self.blocks_for(seq.n_tokens + n_new) - len(seq.blocks)
        return max(0, need - len(seq.reserved))

    def slot(self, seq_id: int, position: int) -> tuple[int, int]:
        """(block id, offset in block) of the token at ``position`` in the sequence."""
        seq = self._seq(seq_id)
        if not 0 <= position < len(seq.blocks) * self.block_size:
            raise IndexError(f"position {position} is outside sequence {seq_id}'s blocks")
        return seq.blocks[position // self.block_size], position % self.block_size

    # -- life cycle --------------------------------------------------------------------------
    def admit(self, seq_id: int, reserve_tokens: int = 0) -> None:
        """Add a sequence. ``reserve_tokens``: set aside blocks for that many tokens now, as one
        contiguous run of block ids when the free list has one (so that attention can read the
        sequence's K/V as a view, without gathering), else wherever they are free."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the pool")
        need = self.blocks_for(reserve_tokens)
        if need > len(self._free):
            raise PoolExhausted(f"the KV pool cannot reserve {need} blocks ({len(self._free)} free); "
                                "give a larger --context or a smaller batch")
        seq = SequenceBlocks(seq_id)
        if need:
            run = self._contiguous_run(need)
            seq.reserved = run if run is not None else [self._free.pop() for _ in range(need)]
            if run is not None:
                taken = set(run)
                self._free = [b for b in self._free if b not in taken]
        self._seqs[seq_id] = seq

    def _contiguous_run(self, n: int) -> list[int] | None:
        """The lowest run of ``n`` consecutive free block ids, if any."""
        free = sorted(self._free)
        start = 0
        for i in range(1, len(free) + 1):
            if i == len(free) or free[i] != free[i - 1] + 1:
                if i - start >= n:
                    return free[start:start + n]
                start = i
        return None

    def grow(self, seq_id: int, n_new: int) -> list[int]:
        """Make room for ``n_new`` more tokens; returns the blocks newly taken (maybe none)."""
        seq = self._seq(seq_id)
        if n_new < 0:
            raise ValueError("a sequence cannot grow by a negative number of tokens")
        need = self.blocks_for(seq.n_tokens + n_new) - len(seq.blocks)
        if need > len(self._free) + len(seq.reserved):
            raise PoolExhausted(
                f"the KV pool is full ({self.n_blocks} blocks of {self.block_size} tokens, "
                f"{len(self._free)} free, {need} needed); give a larger --context or a smaller batch")
        taken = [seq.reserved.pop(0) if seq.reserved else self._free.pop() for _ in range(max(0, need))]
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
        self._release(seq.blocks + seq.reserved)

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
