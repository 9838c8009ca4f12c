"""The policy cache: quantized KV, sinks + window, heavy hitters — any combination — behind the
same seam as the full-precision ``PagedKVCache``:

    cache.begin_step(seq_ids, n_new)
    out = cache.attend(layer_idx, q, k, v)   # q/k/v before RoPE, once per layer
    cache.end_step()

Keys are cached **before RoPE** and rotated at attention time at their positions *in the
cache* (``kvcache/quant_attention.py``), so evicting a token re-indexes everything after it
without touching stored (possibly quantized) keys. Which tokens are held, and which are
quantized, follows ``kvcache/eviction.py``; after each layer's attention the new tokens are
appended, groups older than the residual are quantized and units outside the window are
evicted (heavy hitters kept by accumulated attention mass).

``kv_bytes`` is what the tensors hold (K/V payload plus fp16 group scales and mins) and equals
``cost.kv_bytes(spec, policy, n)`` for every sequence of n tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from localctx.kvcache import eviction
from localctx.kvcache.errors import UserError
from localctx.kvcache.layer_store import LayerStore
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.quant_attention import attend_reference


@dataclass(frozen=True)
class PolicyCacheShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


@dataclass
class _Sequence:
    layers: list[LayerStore]
    n_seen: int = 0  # tokens streamed through the cache (positions in the original stream)
    pending: int = 0  # tokens of the current step
    attended: set = field(default_factory=set)


def check_policy_fits_shape(policy: KVPolicy, head_dim: int) -> None:
    if policy.quantized and head_dim % policy.group_size:
        raise UserError(f"KV policy {policy}: head dim {head_dim} is not a multiple of the group size "
                        f"{policy.group_size}; use g32 or a full-precision KV cache")


class PolicyKVCache:
    def __init__(self, shape: PolicyCacheShape, policy: KVPolicy, rope, *, attention=attend_reference):
        check_policy_fits_shape(policy, shape.head_dim)
        self.shape = shape
        self.policy = policy
        self.rope = rope
        self.attention = attention  # same signature as attend_reference (a fused kernel may replace it)
        self.quantizes = eviction.quantizes(policy)
        self.heavy_units = eviction.heavy_units(policy)
        self.track_mass = bool(self.heavy_units) and policy.window is not None
        self._seqs: dict[int, _Sequence] = {}
        self._step: tuple[int, ...] | None = None

    # -- sequences ---------------------------------------------------------------------------
    def _new_layers(self) -> list[LayerStore]:
        s = self.shape
        return [LayerStore(self.policy, s.n_kv_heads, s.head_dim, s.dtype, s.device, self.quantizes,
                           self.heavy_units) for _ in range(s.n_layers)]

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        self._seqs[seq_id] = _Sequence(self._new_layers())

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def finish(self, seq_id: int) -> None:
        if self._seqs.pop(seq_id, None) is None:
            raise KeyError(f"sequence {seq_id} is not in the cache")

    def reset(self) -> None:
        self._seqs.clear()

    def length(self, seq_id: int) -> int:
        """Tokens streamed through the sequence (held or evicted)."""
        return self._seq(seq_id).n_seen

    def reusable_prefix(self, seq_id: int) -> int:
        """The longest prefix ``truncate`` can keep exactly: all of it while nothing has been
        evicted or quantized, else none (a quantized group or an evicted token cannot be undone)."""
        seq = self._seq(seq_id)
        layer = seq.layers[0]
        if layer.n_groups or layer.n_tokens != seq.n_seen:
            return 0
        return seq.n_seen

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens; only prefixes up to ``reusable_prefix`` (or 0)."""
        seq = self._seq(seq_id)
        if n_tokens == 0:
            self._seqs[seq_id] = _Sequence(self._new_layers())
            return
        if not 0 < n_tokens <= self.reusable_prefix(seq_id):
            raise ValueError(f"sequence {seq_id} cannot be cut to {n_tokens} tokens under KV policy "
                             f"{self.policy} (reusable prefix: {self.reusable_prefix(seq_id)})")
        for layer in seq.layers:
            keep = layer.full_idx.view < n_tokens
            layer._keep_full(keep)
        seq.n_seen = n_tokens

    # -- accounting ----------------------------------------------------------------------------
    def kv_bytes(self, seq_id: int | None = None) -> int:
        return sum(layer.nbytes for s in self._ids(seq_id) for layer in self._seqs[s].layers)

    def kv_tokens(self, seq_id: int | None = None) -> int:
        return sum(self._seqs[s].layers[0].n_tokens for s in self._ids(seq_id))

    def evicted_tokens(self, seq_id: int | None = None) -> int:
        return sum(self._seqs[s].n_seen - self._seqs[s].layers[0].n_tokens for s in self._ids(seq_id))

    # -- the forward seam ----------------------------------------------------------------------
    def begin_step(self, seq_ids: Sequence[int], n_new: int | Sequence[int]) -> None:
        counts = [n_new] * len(seq_ids) if isinstance(n_new, int) else list(n_new)
        if len(counts) != len(seq_ids) or not counts or len(set(counts)) != 1 or counts[0] < 1:
            raise ValueError(f"every sequence in a step must add the same positive number of tokens, got {counts}")
        for s in seq_ids:
            seq = self._seq(s)
            seq.pending, seq.attended = counts[0], set()
        self._step = tuple(seq_ids)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._step is None:
            raise RuntimeError("attend() called outside a step: call begin_step(seq_ids, n_new) first")
        B, T = q.shape[:2]
        if B != len(self._step) or T != self._seqs[self._step[0]].pending:
            raise ValueError(f"attend got [B={B}, T={T}] but the step has {len(self._step)} sequences "
                             f"of {self._seqs[self._step[0]].pending} new tokens")
        outs = []
        for b, seq_id in enumerate(self._step):
            seq = self._seqs[seq_id]
            layer = seq.layers[layer_idx]
            full, groups, q_pos = layer.attention_inputs(k[b], v[b])
            res = self.attention(q[b], q_pos, full, groups, self.rope, want_mass=self.track_mass)
            outs.append(res.out)
            new_mass = layer.add_mass(res.full_mass, res.quant_mass)
            layer.append(k[b], v[b], seq.n_seen, new_mass)
            seen = seq.n_seen + T
            layer.age(seen)
            layer.evict(seen)
            seq.attended.add(layer_idx)
            if len(seq.attended) == self.shape.n_layers:
                seq.n_seen, seq.pending, seq.attended = seen, 0, set()
        return torch.stack(outs)

    def end_step(self) -> None:
        self._step = None

    # -- internals -----------------------------------------------------------------------------
    def _seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not in the cache")
        return seq

    def _ids(self, seq_id: int | None) -> list[int]:
        return list(self._seqs) if seq_id is None else [seq_id]
