"""The policy cache: quantized KV, sinks + window, heavy hitters — any combination — behind the
same seam as the full-precision ``PagedKVCache``:

    cache.begin_step(seq_ids, n_new)
    out = cache.attend(layer_idx, q, k, v)   # q/k/v before RoPE, once per layer
    cache.end_step()                         # or cache.abort_step(): every layer as before the step

Keys are cached **before RoPE** and rotated at attention time at their positions *in the
cache* (``kvcache/quant_attention.py``), so evicting a token re-indexes everything after it
without touching stored (possibly quantized) keys. Which tokens are held, and which are
quantized, follows ``kvcache/eviction.py``: each layer's new tokens are appended to its store
before its attention (which reads the store in place, no copy); after it, groups older than the
residual are quantized and units outside the window are evicted (heavy hitters kept by
accumulated attention mass).

A step of several tokens (a prefill chunk) attends exactly as decoding them one at a time would:
where nothing ages or leaves before its last query it is one causal attention (on the fused
kernel); otherwise each query is masked to what decoding would show it, groups that age during
the chunk in both forms (``kvcache/chunk_view.py``, the reference attention); under heavy
hitters the chunk runs as sub-steps between the points where decoding would evict, since which
units stay depends on the attention mass up to each eviction.

``kv_bytes`` is what the tensors hold (K/V payload plus fp16 group scales and mins) and equals
``cost.kv_bytes(spec, policy, n)`` for every sequence of n tokens.

A model whose layers slide over windows of their own (Gemma 3: five local layers to one global)
gives ``layer_windows`` (one entry per layer, None for a full-attention layer) and, where the
bases differ, one rope per layer. Each such layer runs ``policy.layer_policy(policy, window)``;
where the model's window is the one kept, keys no query of the step can see are dropped before
attention and queries are masked to the window (query − key < window in cache positions)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from localctx.kvcache import chunk_view, eviction
from localctx.kvcache.block_pool import BlockPool, PoolExhausted
from localctx.kvcache.errors import UserError
from localctx.kvcache.layer_store import LayerStore
from localctx.kvcache.policy import KVPolicy, layer_policy
from localctx.kvcache.quant_attention import FullTokens, attend_reference, attend_visible


@dataclass(frozen=True)
class PolicyCacheShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    capacity_tokens: int = 1 << 20  # tokens the pool admits over all sequences (held, not streamed)
    block_size: int = 16


@dataclass
class _Sequence:
    layers: list[LayerStore]
    n_seen: int = 0  # tokens streamed through the cache (positions in the original stream)
    pending: int = 0  # tokens of the current step
    attended: set = field(default_factory=set)
    n_seen_before_step: int = 0


def check_policy_fits_shape(policy: KVPolicy, head_dim: int) -> None:
    if policy.quantized and head_dim % policy.group_size:
        raise UserError(f"KV policy {policy}: head dim {head_dim} is not a multiple of the group size "
                        f"{policy.group_size}; use g32 or a full-precision KV cache")


class PolicyKVCache:
    def __init__(self, shape: PolicyCacheShape, policy: KVPolicy, rope, *, attention=attend_reference,
                 quantize_groups=None, layer_windows: Sequence[int | None] = ()):
        """``rope``: the model's Rotary, or a sequence of one per layer; ``layer_windows``: the
        model's own sliding window per layer (None: full attention), or empty for none."""
        check_policy_fits_shape(policy, shape.head_dim)
        self.shape = shape
        self.policy = policy
        self.ropes = list(rope) if isinstance(rope, (list, tuple)) else [rope] * shape.n_layers
        self.rope = self.ropes[0]
        self.model_windows = tuple(layer_windows) or (None,) * shape.n_layers
        if len(self.ropes) != shape.n_layers or len(self.model_windows) != shape.n_layers:
            raise ValueError(f"{len(self.ropes)} ropes and {len(self.model_windows)} layer windows for "
                             f"{shape.n_layers} layers")
        self.layer_policies = [layer_policy(policy, w) for w in self.model_windows]
        # the layers whose store keeps exactly the model's own window (no sinks, no heavy hitters)
        self.model_window_kept = [w is not None and p.window == w
                                  for w, p in zip(self.model_windows, self.layer_policies)]
        self.attention = attention  # same signature as attend_reference (a fused kernel may replace it)
        self.quantize_groups = quantize_groups  # batched group quantizer (kernels_cuda.dispatch); None: per group
        self.heavy_units = eviction.heavy_units(policy)  # the policy's own budget (a file keeps masses when > 0)
        self.track_mass = [bool(eviction.heavy_units(p)) and p.window is not None for p in self.layer_policies]
        caps = [p.capacity() for p in self.layer_policies]
        self.capacity = None if None in caps else max(caps)  # most tokens any layer holds
        self._seqs: dict[int, _Sequence] = {}
        self._step: tuple[int, ...] | None = None
        # One pool's bookkeeping for every sequence: blocks cover the tokens each one *holds*
        # (quantized and full precision alike), so admission and PoolExhausted work as in the
        # paged cache while a windowed sequence streams on in the same blocks.
        self.pool = BlockPool(max(1, -(-shape.capacity_tokens // shape.block_size)), shape.block_size)

    # -- sequences ---------------------------------------------------------------------------
    def _new_layers(self) -> list[LayerStore]:
        s = self.shape
        return [LayerStore(p, s.n_kv_heads, s.head_dim, s.dtype, s.device, eviction.quantizes(p),
                           eviction.heavy_units(p), self.quantize_groups) for p in self.layer_policies]

    def add_sequence(self, seq_id: int, reserve_tokens: int = 0) -> None:
        """``reserve_tokens``: set aside blocks for that many tokens now (capped at what the policy
        ever holds), as the paged cache does for a batch."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        cap = self.capacity
        held_max = reserve_tokens if cap is None else min(reserve_tokens, cap + self.policy.group_size)
        self.pool.admit(seq_id, held_max)
        self._seqs[seq_id] = _Sequence(self._new_layers())

    def can_admit(self, n_tokens: int) -> bool:
        cap = self.capacity
        held = n_tokens if cap is None else min(n_tokens, cap + self.policy.group_size)
        return self.pool.can_fit(self.pool.blocks_for(held))

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def finish(self, seq_id: int) -> None:
        if self._seqs.pop(seq_id, None) is None:
            raise KeyError(f"sequence {seq_id} is not in the cache")
        self.pool.finish(seq_id)

    def reset(self) -> None:
        self._seqs.clear()
        self.pool.reset()

    def length(self, seq_id: int) -> int:
        """Tokens streamed through the sequence (held or evicted)."""
        return self._seq(seq_id).n_seen

    def can_truncate(self, seq_id: int, n_tokens: int) -> bool:
        """Whether ``truncate(seq_id, n_tokens)`` can keep exactly the first ``n_tokens``: always
        for 0 and for the whole sequence; otherwise only while nothing has been evicted and the
        prefix holds the same quantized groups (a quantized or evicted token cannot be undone)."""
        seq = self._seq(seq_id)
        if n_tokens in (0, seq.n_seen):
            return True
        if not 0 < n_tokens < seq.n_seen:
            return False
        return all(layer.n_tokens == seq.n_seen
                   and eviction.held_counts(p, n_tokens).quant_groups == layer.n_groups
                   for layer, p in zip(seq.layers, self.layer_policies))

    @torch.inference_mode()  # the stores were written under inference mode: cut them back under it too
    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens (see ``can_truncate``)."""
        seq = self._seq(seq_id)
        if not self.can_truncate(seq_id, n_tokens):
            raise ValueError(f"sequence {seq_id} of {seq.n_seen} tokens cannot be cut to {n_tokens} under KV "
                             f"policy {self.policy}: start it again (truncate to 0)")
        if n_tokens == 0:
            self._seqs[seq_id] = _Sequence(self._new_layers())
        elif n_tokens < seq.n_seen:
            for layer in seq.layers:
                layer.truncate(n_tokens)
            seq.n_seen = n_tokens
        self._sync_pool(seq_id)

    # -- undoing the newest tokens (speculative decoding's rollback) -----------------------------
    def append_room(self, seq_id: int, limit: int = 64) -> int:
        """Tokens (up to ``limit``) the next step can append with nothing quantized or evicted on
        the way: attending them in one step then equals attending them one at a time, and
        ``drop_newest`` undoes any number of them exactly. 0 when the very next token ages a group
        or evicts, and always 0 while attention mass is tracked (heavy hitters: every query adds
        mass to every held token, which dropping the query cannot take back)."""
        if any(self.track_mass):
            return 0
        n = self._seq(seq_id).n_seen
        # the tokens after the first that one step attends exactly are the ones appended with nothing changed
        return min(chunk_view.substep_length(p, n, limit + 1) - 1 for p in set(self.layer_policies))

    @torch.inference_mode()
    def drop_newest(self, seq_id: int, n_tokens: int) -> None:
        """Forget the last ``n_tokens`` of the sequence, appended by a step within ``append_room``
        (they are the newest full-precision rows of every layer; nothing else changed)."""
        if n_tokens <= 0:
            return
        seq = self._seq(seq_id)
        keep = seq.n_seen - n_tokens
        now, then = eviction.held_counts(self.policy, seq.n_seen), eviction.held_counts(self.policy, keep)
        if keep < 0 or now.quant_groups != then.quant_groups or now.tokens != then.tokens + n_tokens:
            raise ValueError(f"the last {n_tokens} of {seq.n_seen} tokens were not a plain append under KV policy "
                             f"{self.policy}: they cannot be dropped exactly")
        for layer in seq.layers:
            layer.drop_newest(n_tokens)
        seq.n_seen = keep
        self._sync_pool(seq_id)

    # -- the prompt cache on disk (kvcache/prompt_cache.py) ---------------------------------------
    _IMPLIED = ("full_idx", "full_mass", "q_idx", "q_mass")

    def layer_groups(self) -> list[list[int]]:
        """Layer indices by the policy they run, in layer order of first use: one group, or a model's
        full-attention layers and its sliding ones (Gemma 3), whose stores hold different rows."""
        groups: dict[KVPolicy, list[int]] = {}
        for i, p in enumerate(self.layer_policies):
            groups.setdefault(p, []).append(i)
        return list(groups.values())

    @staticmethod
    def _group_suffixes(groups: list[list[int]]) -> list[str]:
        """The suffix of each group's tensors: none for a single group (the layout every file of a model
        without sliding layers has), ``@g`` otherwise."""
        return [""] if len(groups) == 1 else [f"@{g}" for g in range(len(groups))]

    def export_sequence(self, seq_id: int) -> dict[str, torch.Tensor]:
        """The whole sequence in its own format: for each group of layers running one policy
        (``layer_groups``), each store's filled rows stacked over its layers (quantized codes and
        scales as held), plus the stream length and each group's window start (``n_seen``). Without
        heavy hitters the stream indices follow from the counts and the mass is unused, so only
        the K/V payload is written."""
        seq = self._seq(seq_id)
        skip = () if self.heavy_units else self._IMPLIED
        groups = self.layer_groups()
        out = {}
        for idx, suffix in zip(groups, self._group_suffixes(groups)):
            out.update({name + suffix: torch.stack([seq.layers[i].rows()[name].view for i in idx])
                        for name in seq.layers[idx[0]].rows() if name not in skip})
        starts = [seq.layers[idx[0]].main_start for idx in groups]
        out["n_seen"] = torch.tensor([seq.n_seen, *starts], dtype=torch.long)
        return out

    def _implied_rows(self, p: KVPolicy, n_seen: int, n_full: int, n_groups: int) -> dict[str, torch.Tensor]:
        """Stream indices (and zero mass) of a store without heavy hitters: the sinks, then the
        newest tokens as one run — head group, quantized groups, full-precision tail, in order (``p``:
        the layer's policy)."""
        dev = self.shape.device
        g, sinks = p.group_size, min(p.sinks, n_seen)
        held = n_full + n_groups * g
        run = torch.arange(n_seen - (held - sinks), n_seen, device=dev)
        head = eviction.head_groups(p) * g if n_groups else 0
        full_idx = torch.cat([torch.arange(sinks, device=dev), run[:head], run[head + n_groups * g:]])
        q_idx = run[head:head + n_groups * g].reshape(n_groups, g)
        return {"full_idx": full_idx, "full_mass": torch.zeros(n_full, device=dev),
                "q_idx": q_idx, "q_mass": torch.zeros(n_groups, g, device=dev)}

    @torch.inference_mode()
    def import_sequence(self, seq_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """A new sequence holding what ``export_sequence`` gave."""
        groups = self.layer_groups()
        n_seen, *starts = (int(x) for x in tensors["n_seen"])
        if len(starts) != len(groups):
            raise ValueError(f"the tensors hold {len(starts)} groups of layers, not this cache's {len(groups)}")
        layers = self._new_layers()
        skip = set() if self.heavy_units else set(self._IMPLIED)
        expected = {name + suffix for idx, suffix in zip(groups, self._group_suffixes(groups))
                    for name in set(layers[idx[0]].rows()) - skip}
        if expected != set(tensors) - {"n_seen"}:
            raise ValueError(f"the tensors {sorted(set(tensors) - {'n_seen'})} are not this policy's {sorted(expected)}")
        for idx, suffix, main_start in zip(groups, self._group_suffixes(groups), starts):
            n_full = tensors["full_k" + suffix].shape[1]
            group_rows = next((name for name in ("qk_codes", "qk_full") if name + suffix in tensors), None)
            n_groups = tensors[group_rows + suffix].shape[1] if group_rows else 0
            implied = ({} if self.heavy_units else
                       self._implied_rows(self.layer_policies[idx[0]], n_seen, n_full, n_groups))
            for j, i in enumerate(idx):
                for name, rows in layers[i].rows().items():
                    rows.append(implied[name] if name in implied else tensors[name + suffix][j].to(rows.buf.device))
                layers[i].main_start = main_start
        self.pool.admit(seq_id, max(layer.n_tokens for layer in layers))
        self._seqs[seq_id] = _Sequence(layers, n_seen=n_seen)
        self._sync_pool(seq_id)

    # -- accounting ----------------------------------------------------------------------------
    def kv_bytes(self, seq_id: int | None = None) -> int:
        return sum(layer.nbytes for s in self._ids(seq_id) for layer in self._seqs[s].layers)

    def kv_tokens(self, seq_id: int | None = None) -> int:
        """Tokens held by the layer that holds the most (a model's sliding layers hold fewer)."""
        return sum(self._held(s) for s in self._ids(seq_id))

    def evicted_tokens(self, seq_id: int | None = None) -> int:
        return sum(self._seqs[s].n_seen - self._held(s) for s in self._ids(seq_id))

    # -- the forward seam ----------------------------------------------------------------------
    def begin_step(self, seq_ids: Sequence[int], n_new: int | Sequence[int]) -> None:
        counts = [n_new] * len(seq_ids) if isinstance(n_new, int) else list(n_new)
        if len(counts) != len(seq_ids) or not counts or len(set(counts)) != 1 or counts[0] < 1:
            raise ValueError(f"every sequence in a step must add the same positive number of tokens, got {counts}")
        pool = self.pool
        need = sum(pool.blocks_for(self._held(s) + counts[0]) - len(pool.block_table(s))
                   for s in seq_ids)
        if not pool.can_fit(need):
            raise PoolExhausted(f"the KV pool is full ({pool.n_blocks} blocks of {pool.block_size} tokens, "
                                f"{pool.free_blocks} free, {need} needed); give a larger --context or a smaller batch")
        for s in seq_ids:
            seq = self._seq(s)
            seq.pending, seq.attended, seq.n_seen_before_step = counts[0], set(), seq.n_seen
            for layer in seq.layers:
                layer.checkpoint()
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
            policy, kept = self.layer_policies[layer_idx], self.model_window_kept[layer_idx]
            if self.track_mass[layer_idx]:  # heavy hitters: sub-steps between the evictions
                parts, done = [], 0
                while done < T:
                    r = chunk_view.substep_length(policy, seq.n_seen + done, T - done)
                    parts.append(self._attend_plain(layer_idx, layer, seq.n_seen + done, q[b, done:done + r],
                                                    k[b, done:done + r], v[b, done:done + r]))
                    done += r
                    layer.age(seq.n_seen + done)
                    layer.evict(seq.n_seen + done)
                outs.append(torch.cat(parts))
            else:
                if chunk_view.appends_only(policy, seq.n_seen, T, kept):
                    outs.append(self._attend_plain(layer_idx, layer, seq.n_seen, q[b], k[b], v[b]))
                else:
                    outs.append(self._attend_chunk(layer_idx, layer, seq.n_seen, q[b], k[b], v[b]))
                layer.age(seq.n_seen + T)
                layer.evict(seq.n_seen + T)
            seq.attended.add(layer_idx)
            if len(seq.attended) == self.shape.n_layers:
                seq.n_seen, seq.pending, seq.attended = seq.n_seen + T, 0, set()
                self._sync_pool(seq_id)
        return torch.stack(outs)

    def _attend_plain(self, layer_idx: int, layer: LayerStore, n_seen: int, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """Tokens whose queries see the cache as it stands plus the earlier of them (one decode
        step, or a chunk within ``chunk_view.appends_only``): one causal attention, on the fused
        kernel where no window mask is needed. Accumulates attention mass where it is tracked."""
        T = q.shape[0]
        layer.append(k, v, n_seen)  # attention reads the store in place, new tokens included
        window = self.model_windows[layer_idx]
        if self.model_window_kept[layer_idx]:
            layer.evict(n_seen + 1)  # what even the first query cannot see
        full, groups, q_pos = layer.attention_inputs(T)
        rope, mass = self.ropes[layer_idx], self.track_mass[layer_idx]
        if window is not None and layer.n_tokens > window:  # the window mask can hide a held key
            res = attend_reference(q, q_pos, full, groups, rope, want_mass=mass, window=window,
                                   sinks=self.layer_policies[layer_idx].sinks)
        else:
            res = self.attention(q, q_pos, full, groups, rope, want_mass=mass)
        layer.add_mass(res.full_mass, res.quant_mass)
        return res.out

    def _attend_chunk(self, layer_idx: int, layer: LayerStore, n_seen: int, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """A chunk whose queries see different caches (``kvcache/chunk_view.py``): the store ages
        to what the last query sees, the groups that aged on the way are attended in both forms,
        and each query is masked to what decoding would show it. This runs the reference
        attention (the fused kernels take no per-query mask) and tracks no attention mass."""
        T, policy = q.shape[0], self.layer_policies[layer_idx]
        kept = self.model_window_kept[layer_idx]
        layer.append(k, v, n_seen)
        if kept:
            layer.evict(n_seen + 1)  # what even the first query cannot see
        aged = None
        if layer.quantizes:  # the full-precision rows of the groups that age before the last query
            S, g = policy.sinks, policy.group_size
            idx = layer.full_idx.view
            group = torch.div(idx - S, g, rounding_mode="floor")
            ages = (idx >= S + layer.head_groups * g) & ((group + 1) * g <= n_seen + T - 1 - S - policy.residual)
            if bool(ages.any()):
                aged = (layer.full_k.view[ages], layer.full_v.view[ages], idx[ages])  # copies
            layer.age(n_seen + T - 1)
        full, groups, _ = layer.attention_inputs(T)
        full_idx, group_idx = layer.stream_indices()
        index = [full_idx] if group_idx is None else [group_idx.reshape(-1), full_idx]
        quantized = [torch.zeros_like(full_idx, dtype=torch.bool)]
        if group_idx is not None:
            quantized.insert(0, torch.ones(group_idx.numel(), dtype=torch.bool, device=full_idx.device))
        if aged is not None:
            full = FullTokens(torch.cat([full.k, aged[0].transpose(0, 1)], dim=1),
                              torch.cat([full.v, aged[1].transpose(0, 1)], dim=1), full.positions)
            index.append(aged[2])
            quantized.append(torch.zeros_like(aged[2], dtype=torch.bool))
        view = chunk_view.chunk_view(policy, torch.arange(n_seen, n_seen + T, device=full_idx.device),
                                     torch.cat(index), torch.cat(quantized), evicts_first=kept,
                                     model_window=self.model_windows[layer_idx])
        return attend_visible(q, full, groups, self.ropes[layer_idx], view).out

    def end_step(self) -> None:
        for seq in self._step_sequences():
            for layer in seq.layers:
                layer.commit()
        self._step = None

    @torch.inference_mode()  # the stores were written under inference mode: put them back under it too
    def abort_step(self) -> None:
        """Undo the step in progress (a forward that raised in some layer): every layer of its
        sequences returns exactly to its state before ``begin_step`` (held tokens, quantized
        groups, attention mass), whichever layers had already attended."""
        for seq_id in self._step or ():
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            for layer in seq.layers:
                layer.restore()
            seq.n_seen, seq.pending, seq.attended = seq.n_seen_before_step, 0, set()
            self._sync_pool(seq_id)
        self._step = None

    # -- internals -----------------------------------------------------------------------------
    def _seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not in the cache")
        return seq

    def _held(self, seq_id: int) -> int:
        return max(layer.n_tokens for layer in self._seqs[seq_id].layers)

    def _step_sequences(self) -> list[_Sequence]:
        return [self._seqs[s] for s in self._step or () if s in self._seqs]

    def _sync_pool(self, seq_id: int) -> None:
        held, have = self._held(seq_id), self.pool.length(seq_id)
        if held > have:
            self.pool.grow(seq_id, held - have)
        else:
            self.pool.truncate(seq_id, held)

    def _ids(self, seq_id: int | None) -> list[int]:
        return list(self._seqs) if seq_id is None else [seq_id]

