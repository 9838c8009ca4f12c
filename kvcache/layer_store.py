"""One layer of one sequence in a policy cache: full-precision tokens and quantized groups, each
with its stream index and accumulated attention mass, kept in stream order (kvcache/eviction.py
states the rules this applies).

Storage grows by doubling (``Rows``); what the store *holds* — and reports in ``nbytes`` — is
the filled rows only: K/V payload plus the fp16 scale/min of the quantized groups.

A step can be undone exactly (``checkpoint`` / ``restore`` / ``commit``): each ``Rows`` then keeps
its buffer, start and length from the checkpoint, and a copy of any checkpointed rows a write
overwrites in place (eviction moves rows inside the buffer, attention mass accumulates in place),
so an undo log costs at most what the step's own writes cost."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from localctx.kvcache import eviction, quant
from localctx.kvcache.eviction_masks import keep_heaviest, leaving
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.quant_attention import FullTokens, QuantGroups


@dataclass
class _RowsMark:
    buf: torch.Tensor
    start: int
    n: int
    saved: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (buffer row, rows as they were)


class Rows:
    """A tensor that grows along its first axis; ``view`` is the filled part, which starts at
    ``start`` in the buffer.

    A sliding window drops, at each step, the oldest rows after a short head (the sinks):
    ``drop_run`` then moves the head forward over them and advances ``start`` instead of moving
    the whole window down, so a step costs the head's size, not the window's. ``append`` moves the
    rows back to the front when the buffer's end is reached and there is room (at most once per
    buffer length of appends), and grows the buffer by doubling otherwise."""

    def __init__(self, tail: tuple[int, ...], dtype: torch.dtype, device: str | torch.device):
        self.buf = torch.empty((0, *tail), dtype=dtype, device=device)
        self.n = 0
        self.start = 0
        self._mark: _RowsMark | None = None

    # -- undo ------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Start recording what ``restore`` needs to return to this state exactly."""
        self._mark = _RowsMark(self.buf, self.start, self.n)

    def commit(self) -> None:
        self._mark = None

    def restore(self) -> None:
        """Back to the state at ``checkpoint`` (a no-op without one)."""
        mark, self._mark = self._mark, None
        if mark is None:
            return
        for row, rows in reversed(mark.saved):
            mark.buf[row:row + rows.shape[0]] = rows
        self.buf, self.start, self.n = mark.buf, mark.start, mark.n

    def _overwriting(self, a: int, b: int) -> None:
        """Buffer rows [a, b) are about to be written in place: keep the checkpointed ones."""
        mark = self._mark
        if mark is None or self.buf is not mark.buf:  # no checkpoint, or a new buffer since
            return
        lo, hi = max(a, mark.start), min(b, mark.start + mark.n)
        if lo < hi:
            mark.saved.append((lo, self.buf[lo:hi].clone()))

    @property
    def view(self) -> torch.Tensor:
        return self.buf[self.start:self.start + self.n]

    @property
    def nbytes(self) -> int:
        return self.view.numel() * self.buf.element_size()

    def append(self, x: torch.Tensor) -> None:
        need = self.n + x.shape[0]
        if self.start + need > self.buf.shape[0]:
            capacity = self.buf.shape[0] if 2 * need <= self.buf.shape[0] else max(need, 2 * self.buf.shape[0], 16)
            moved = torch.empty((capacity, *self.buf.shape[1:]), dtype=self.buf.dtype, device=self.buf.device)
            moved[:self.n] = self.view
            self.buf, self.start = moved, 0
        self._overwriting(self.start + self.n, self.start + need)
        self.buf[self.start + self.n:self.start + need] = x.to(self.buf.dtype)
        self.n = need

    def add_(self, x: torch.Tensor) -> None:
        """Add ``x`` to the filled rows in place."""
        self._overwriting(self.start, self.start + self.n)
        self.view.add_(x)

    def keep(self, mask: torch.Tensor) -> None:
        dropped = (~mask).nonzero().flatten()
        k = dropped.numel()
        if k == 0:
            return
        head = int(dropped[0])
        if int(dropped[-1]) - head + 1 == k:  # one run
            self.drop_run(head, k)
            return
        kept = self.view[mask]
        self._overwriting(self.start, self.start + kept.shape[0])
        self.buf[self.start:self.start + kept.shape[0]] = kept
        self.n = kept.shape[0]

    def drop_run(self, head: int, k: int) -> None:
        """Drop the ``k`` rows after the first ``head``: the shorter side of the gap moves."""
        if k <= 0:
            return
        s, tail = self.start, self.n - head - k
        if head <= tail:
            if head:
                self._overwriting(s + k, s + k + head)
                self.buf[s + k:s + k + head] = self.buf[s:s + head].clone()
            self.start = s + k
        elif tail:
            self._overwriting(s + head, s + head + tail)
            self.buf[s + head:s + head + tail] = self.buf[s + head + k:s + self.n].clone()
        self.n -= k


class LayerStore:
    def __init__(self, policy: KVPolicy, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str | torch.device, quantizes: bool, heavy_units: int, quantize_groups=None):
        self.policy = policy
        # (k, v [G, H, g, D], bits, g) -> stacked (keys, values); None: kvcache.quant per group
        self.quantize_groups = quantize_groups
        self.quantizes = quantizes
        self.head_groups = eviction.head_groups(policy)
        self.heavy_units = heavy_units
        # a plain window over full-precision tokens holds the sinks and one contiguous run of
        # the newest tokens, starting at stream index ``main_start``: evicting is arithmetic
        self.window_only = policy.window is not None and not quantizes and heavy_units == 0
        self.main_start = policy.sinks
        self._main_start_mark: int | None = None  # main_start at the last checkpoint
        H, D, g = n_kv_heads, head_dim, policy.group_size
        self.full_k = Rows((H, D), dtype, device)  # [N, H, D] before RoPE
        self.full_v = Rows((H, D), dtype, device)
        # stream index and attention mass per full token; a plain window needs neither
        self.full_idx = None if self.window_only else Rows((), torch.long, device)
        self.full_mass = None if self.window_only else Rows((), torch.float32, device)
        self._full_rows = [r for r in (self.full_k, self.full_v, self.full_idx, self.full_mass) if r is not None]
        # the quantized groups, each side at its own precision: codes + scale + min, or (a side at
        # 16 bits, e.g. kf16v4's keys) the group's rows as they are
        self._payload: dict[str, Rows] = {}
        if quantizes:
            k_bits, v_bits = policy.k_bits, policy.v_bits
            if k_bits < 16:
                self._payload.update(qk_codes=Rows((H, g, D * k_bits // 8), torch.uint8, device),
                                     qk_scale=Rows((H, 1, D), quant.SCALE_DTYPE, device),
                                     qk_min=Rows((H, 1, D), quant.SCALE_DTYPE, device))
            else:
                self._payload["qk_full"] = Rows((H, g, D), dtype, device)
            if v_bits < 16:
                self._payload.update(qv_codes=Rows((H, g, D * v_bits // 8), torch.uint8, device),
                                     qv_scale=Rows((H, g, D // g), quant.SCALE_DTYPE, device),
                                     qv_min=Rows((H, g, D // g), quant.SCALE_DTYPE, device))
            else:
                self._payload["qv_full"] = Rows((H, g, D), dtype, device)
            self.q_idx = Rows((g,), torch.long, device)
            self.q_mass = Rows((g,), torch.float32, device)

    # -- undoing a step ----------------------------------------------------------------------
    def _all_rows(self) -> list[Rows]:
        return self._full_rows + self._quant_rows()

    def checkpoint(self) -> None:
        """Record this state; ``restore`` returns to it exactly (quantized groups and attention
        mass included), ``commit`` drops the record."""
        self._main_start_mark = self.main_start
        for rows in self._all_rows():
            rows.checkpoint()

    def commit(self) -> None:
        for rows in self._all_rows():
            rows.commit()
        self._main_start_mark = None

    def restore(self) -> None:
        """Back to the last ``checkpoint`` (a no-op without one)."""
        for rows in self._all_rows():
            rows.restore()
        if self._main_start_mark is not None:
            self.main_start, self._main_start_mark = self._main_start_mark, None

    # -- what attention reads ------------------------------------------------------------
    def _quant_rows(self) -> list[Rows]:
        if not self.quantizes:
            return []
        return [*self._payload.values(), self.q_idx, self.q_mass]

    def rows(self) -> dict[str, Rows]:
        """Every row store this layer keeps, by name (what a prompt-cache file holds)."""
        names = ["full_k", "full_v"] + ([] if self.window_only else ["full_idx", "full_mass"])
        out = {name: getattr(self, name) for name in names}
        if self.quantizes:
            out.update(self._payload, q_idx=self.q_idx, q_mass=self.q_mass)
        return out

    @property
    def n_groups(self) -> int:
        return self.q_idx.n if self.quantizes else 0

    @property
    def n_tokens(self) -> int:
        return self.full_k.n + self.n_groups * self.policy.group_size

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in [self.full_k, self.full_v, *self._payload.values()])

    def stream_indices(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stream index of every held full token [N] and group token [G, g]."""
        groups = self.q_idx.view if self.n_groups else None
        if not self.window_only:
            return self.full_idx.view, groups
        n, S, device = self.full_k.n, self.policy.sinks, self.full_k.buf.device
        if n <= S:
            return torch.arange(n, device=device), groups
        return torch.cat([torch.arange(S, device=device),
                          torch.arange(self.main_start, self.main_start + n - S, device=device)]), groups

    def positions(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """In-cache positions (rank in stream order) of the full tokens [N] and groups [G, g]."""
        if not self.n_groups:  # the full tokens are already in stream order
            return torch.arange(self.full_k.n, device=self.full_k.buf.device), None
        full_idx = self.full_idx.view
        q_idx = self.q_idx.view
        q_flat = q_idx.reshape(-1)
        # both lists are in stream order, so a token's rank is its index in its own list plus the
        # number of tokens of the other list before it (a merge, not a sort of everything)
        full_rank = torch.arange(full_idx.numel(), device=full_idx.device) + torch.searchsorted(q_flat, full_idx)
        q_rank = torch.arange(q_flat.numel(), device=q_flat.device) + torch.searchsorted(full_idx, q_flat)
        return full_rank, q_rank.reshape(q_idx.shape)

    def attention_inputs(self, n_new: int) -> tuple[FullTokens, QuantGroups | None, torch.Tensor]:
        """Every held token, the step's ``n_new`` (already appended) last among the full-precision
        ones, as views of the store; returns the new tokens' positions too."""
        full_pos, q_pos = self.positions()
        full = FullTokens(self.full_k.view.transpose(0, 1), self.full_v.view.transpose(0, 1), full_pos)
        groups = None
        if self.n_groups:
            groups = QuantGroups(self._side("qk"), self._side("qv"), q_pos, self.policy.group_size)
        return full, groups, full_pos[-n_new:]

    def _side(self, name: str) -> quant.QuantizedTensor | quant.FullGroups:
        """One side of the quantized groups as attention reads it ("qk": keys, "qv": values)."""
        rows = self._payload
        if name + "_full" in rows:
            return quant.FullGroups(rows[name + "_full"].view)
        bits = self.policy.k_bits if name == "qk" else self.policy.v_bits
        return quant.QuantizedTensor(rows[name + "_codes"].view, rows[name + "_scale"].view,
                                     rows[name + "_min"].view, bits)

    # -- around attention: append the step's tokens, accumulate mass, age, evict ------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, first_index: int) -> None:
        """The step's new tokens ([T, H, D], before RoPE), before they attend (with no mass yet)."""
        T = k.shape[0]
        self.full_k.append(k)
        self.full_v.append(v)
        if self.window_only:
            return
        self.full_idx.append(torch.arange(first_index, first_index + T, device=k.device))
        self.full_mass.append(torch.zeros(T, device=k.device))

    def add_mass(self, full_mass: torch.Tensor | None, quant_mass: torch.Tensor | None) -> None:
        """Accumulate the attention mass of every held token (None when untracked)."""
        if full_mass is None:
            return
        self.full_mass.add_(full_mass)
        if quant_mass is not None:
            self.q_mass.add_(quant_mass)

    def age(self, n_seen: int) -> None:
        """Quantize every whole group past the head that is older than the residual (rule 2)."""
        if not self.quantizes:
            return
        p = self.policy
        g, S = p.group_size, p.sinks
        m = max(0, n_seen - S)
        idx = self.full_idx.view
        tail = idx >= S + self.head_groups * g  # the sinks and the head stay full precision
        n_tail = int(tail.sum())
        first = int(idx[tail][0]) - S if n_tail else 0
        n_groups = max(0, (m - p.residual - first) // g) if n_tail else 0
        if n_groups == 0:
            return
        start = self.full_idx.n - n_tail  # sinks and head come first in stream order
        take = slice(start, start + n_groups * g)
        H, D = self.full_k.buf.shape[1:]
        k = self.full_k.view[take].reshape(n_groups, g, H, D).transpose(1, 2)
        v = self.full_v.view[take].reshape(n_groups, g, H, D).transpose(1, 2)
        if self.quantize_groups is not None and not p.split:  # one batched call (a fused kernel on CUDA)
            qk, qv = self.quantize_groups(k, v, p.k_bits, g)
        else:  # all the aged groups at once, each side at its own precision
            qk = quant.quantize_keys(k, p.k_bits) if p.k_bits < 16 else quant.FullGroups(k)
            qv = quant.quantize_values(v, p.v_bits, g) if p.v_bits < 16 else quant.FullGroups(v)
        self._append_side("qk", qk)
        self._append_side("qv", qv)
        self.q_idx.append(self.full_idx.view[take].reshape(n_groups, g))
        self.q_mass.append(self.full_mass.view[take].reshape(n_groups, g))
        keep = torch.ones(self.full_idx.n, dtype=torch.bool, device=idx.device)
        keep[take] = False
        self.keep_full(keep)

    def _append_side(self, name: str, side: quant.QuantizedTensor | quant.FullGroups) -> None:
        rows = self._payload
        if side.bits == 16:
            rows[name + "_full"].append(side.data)
        else:
            rows[name + "_codes"].append(side.codes)
            rows[name + "_scale"].append(side.scale)
            rows[name + "_min"].append(side.min)

    def evict(self, n_seen: int) -> None:
        """Drop units outside the window that are not among the heaviest (rules 3 and 4)."""
        p = self.policy
        if p.window is None:
            return
        S = p.sinks
        m = max(0, n_seen - S)
        if self.window_only:  # rule 3 without masks: the run before ``cut`` leaves, after the S sinks
            cut = S + m - p.window
            if cut > self.main_start:
                for rows in self._full_rows:
                    rows.drop_run(S, cut - self.main_start)
                self.main_start = cut
            return
        idx = self.full_idx.view
        out = leaving(idx - S, m, p.window, idx < S)
        if bool(out.any()):
            keep = ~out
            keep[out] = keep_heaviest(self.full_mass.view[out], 0 if self.quantizes else self.heavy_units)
            self.keep_full(keep)
        if self.n_groups:
            q_idx = self.q_idx.view
            out = leaving(q_idx[:, -1] - S, m, p.window, torch.zeros_like(q_idx[:, -1], dtype=torch.bool))
            if bool(out.any()):
                keep = ~out
                keep[out] = keep_heaviest(self.q_mass.view[out].sum(-1), self.heavy_units)
                for rows in self._quant_rows():
                    rows.keep(keep)

    def keep_full(self, keep: torch.Tensor) -> None:
        for rows in self._full_rows:
            rows.keep(keep)

    def truncate(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` of a store that has evicted nothing, cutting full-precision
        tokens only (``PolicyKVCache.can_truncate`` checks both)."""
        if self.window_only:  # stream order is row order
            for rows in self._full_rows:
                rows.drop_run(n_tokens, rows.n - n_tokens)
        else:
            self.keep_full(self.full_idx.view < n_tokens)

    def drop_newest(self, n_tokens: int) -> None:
        """Forget the newest ``n_tokens`` full-precision rows (a step that only appended)."""
        if not 0 <= n_tokens <= self.full_k.n:
            raise ValueError(f"cannot drop {n_tokens} of {self.full_k.n} full-precision rows")
        for rows in self._full_rows:
            rows.n -= n_tokens
