"""One layer's full-precision keys and values (sinks, the head group, the residual, a plain fp16
cache) in buffers written in place, as mlx-lm's KVCache keeps its keys: appending one token writes
one row instead of copying every held row into a new array (what concatenation did each step).

``FullRows`` holds (Hkv, capacity, D) buffers whose first ``n`` rows are the held tokens. When an
append does not fit, the buffer grows to the next multiple of ``step`` rows that holds it (one copy of
the held rows, the new ones and zeros after them; from empty, the capacities mlx-lm's KVCache takes);
otherwise the rows are written with slice assignment, which MLX does
in place when nothing else holds the old buffer — the previous step's views are gone by then, and a
snapshot (``LayerCache.snapshot``) holds the ``FullRows`` object, whose buffer follows the write
and whose ``n`` says what it held. Rows below a snapshot's ``n`` are never written again: a layer
that restores one stops writing in place (``owned``) until its next growth copies the buffer.

Bytes: ``nbytes`` is what the held rows take (what ``kvcache.cost.kv_bytes`` counts, the figure
every report and test uses); ``allocated`` is the buffers' size, which the unused rows after
``n`` make larger (fewer than ``step`` rows per buffer)."""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class FullRows:
    k: mx.array  # (Hkv, capacity, D) buffers; rows [0, n) are held
    v: mx.array
    n: int
    owned: bool = True  # rows at and after n may be written in place

    @classmethod
    def empty(cls, n_kv_heads: int, head_dim: int, dtype: mx.Dtype) -> "FullRows":
        z = mx.zeros((n_kv_heads, 0, head_dim), dtype)
        return cls(z, z, 0)

    @classmethod
    def of(cls, k: mx.array, v: mx.array) -> "FullRows":
        """Rows held exactly (a gather, a loaded file): the next append grows them."""
        return cls(k, v, int(k.shape[1]))

    @property
    def capacity(self) -> int:
        return int(self.k.shape[1])

    def keys(self) -> mx.array:
        """(Hkv, n, D): the held keys (the buffer itself when it is full)."""
        return self.k if self.n == self.capacity else self.k[:, :self.n]

    def values(self) -> mx.array:
        return self.v if self.n == self.capacity else self.v[:, :self.n]

    def nbytes(self) -> int:
        """Bytes of the held rows (``kvcache.cost.kv_bytes``'s count)."""
        k, v = self.k, self.v
        return self.n * (k.shape[0] * k.shape[2] + v.shape[0] * v.shape[2]) * k.dtype.size

    def allocated(self) -> int:
        """Bytes of the buffers, held rows and the spare ones after them."""
        return self.k.nbytes + self.v.nbytes

    def append(self, k: mx.array, v: mx.array, step: int) -> "FullRows":
        """k, v (Hkv, L, D) in the buffers' dtype: written in place where they fit (the same buffer
        objects, so this ``FullRows`` still holds its ``n`` rows), else copied into new buffers of the
        next multiple of ``step`` rows (``step`` 1: exactly these)."""
        length = int(k.shape[1])
        end = self.n + length
        if self.owned and end <= self.capacity:
            self.k[:, self.n:end] = k
            self.v[:, self.n:end] = v
            return FullRows(self.k, self.v, end)
        spare = -end % step if step > 1 else 0
        if spare:
            pad = mx.zeros((k.shape[0], spare, k.shape[2]), k.dtype)
            return FullRows(mx.concatenate([self.keys(), k, pad], axis=1),
                            mx.concatenate([self.values(), v, pad], axis=1), end)
        return FullRows(mx.concatenate([self.keys(), k], axis=1), mx.concatenate([self.values(), v], axis=1), end)

    def taken(self, rows: mx.array) -> "FullRows":
        """Only the held rows ``rows`` (int32 indices, in order), in new exact buffers."""
        return FullRows.of(self.k[:, rows], self.v[:, rows])

    def restored(self) -> "FullRows":
        """These rows as a restored snapshot holds them: later appends must not write into the
        buffer, whose rows after ``n`` another snapshot may hold."""
        return FullRows(self.k, self.v, self.n, owned=False)
