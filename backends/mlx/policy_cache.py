"""localctx's KV policies as MLX caches: one ``LayerCache`` per layer, every combination of
precision (fp16 / int8 / int4 + residual), sinks + window and heavy hitters, with the rules of
kvcache/eviction.py (the torch backend's policy cache follows the same ones):

sinks stay full precision; the main stream is quantized an aligned group of ``group_size``
tokens at a time once the group is older than the residual (only when a group can age out of
the residual inside the window; without a window the first group, the head, stays full
precision); a unit — a full-precision token or a whole quantized group —
leaves when its newest token falls out of the window, and the units that left compete for the
heavy-hitter budget by accumulated attention mass.

A layer holds a full-precision store and a group-quantized store, both with keys *before*
RoPE and both in stream order. Attention rotates each key at its position in the cache (its
rank among the kept tokens) and each query at its own, so sinks stream past the trained
context (StreamingLLM). The bytes held equal ``kvcache.cost.kv_bytes``.

A prefill chunk attends exactly as decoding its tokens one at a time would, as the torch policy
cache does: one causal attention where nothing ages or leaves before its last query; otherwise
each query masked to the cache decoding would show it, groups that age during the chunk in both
forms (``kvcache/chunk_view.py``); under heavy hitters, sub-steps between the evictions.

A model whose layers slide over windows of their own (Gemma 3) gives ``ModelCache`` one window
per layer (None: full attention) and one RoPE table per layer; such a layer runs
``kvcache.policy.layer_policy(policy, window)``. Where the model's window is the one kept, the
keys no query of a step can see are dropped before attention, and queries are masked to the
window (query − key < window in cache positions) — as the torch policy cache does.
"""
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from localctx.backends.mlx.chunk_attention import chunk_attention, view_attention
from localctx.backends.mlx.full_rows import FullRows
from localctx.kernels_metal.decode_attention import DecodeParams, QuantizedKV, decode_attention, dense_keys_values
from localctx.kernels_metal.quant import QuantFormat
from localctx.kernels_metal.quant_append import QuantStore, quantize_append
from localctx.kernels_metal.rope import rope_at
from localctx.kvcache import chunk_view, eviction
from localctx.kvcache.policy import KVPolicy, layer_policy, uniform_bits


FULL_STEP = 256  # rows a plain full-precision cache grows by (mlx-lm's KVCache.step)


@dataclass(frozen=True)
class CacheShape:
    n_kv_heads: int
    head_dim: int
    full_dtype: mx.Dtype  # float16, or float32 for fp32 models (kvcache spec's kv_elem_bytes)
    traditional_rope: bool


class LayerCache:
    def __init__(self, policy: KVPolicy, shape: CacheShape, inv_freq: mx.array, model_window: int | None = None):
        """``model_window``: the model's own sliding window on this layer (None: full attention);
        the layer then runs ``layer_policy(policy, model_window)``."""
        self.model_window = model_window
        policy = layer_policy(policy, model_window)
        self.window_kept = model_window is not None and policy.window == model_window
        self.policy = policy
        self.shape = shape
        self.inv_freq = inv_freq
        self.fmt = QuantFormat(uniform_bits(policy) if policy.quantized else 8, policy.group_size)
        self.quantizes = eviction.quantizes(policy)
        self.heavy_units = eviction.heavy_units(policy)
        self.head = eviction.head_groups(policy)  # groups at the start of the main stream kept full precision
        self.track_mass = bool(self.heavy_units) and policy.window is not None
        # full-precision rows grow by this many at a time (full_rows.py): a plain cache by mlx-lm's
        # KVCache step, one that quantizes by a group (its full part stays that small), and one that
        # evicts full-precision tokens every step exactly (it copies what stays each step anyway)
        evicts_full = (policy.evicts or self.window_kept) and not self.quantizes
        self.full_step = 1 if evicts_full else self.fmt.group_size if self.quantizes else FULL_STEP
        self.reset()

    def reset(self) -> None:
        s = self.shape
        self.store = self.empty_store()
        self.q_ids = np.zeros(0, dtype=np.int64)
        self.q_mass = np.zeros(0, dtype=np.float32)
        self.full = FullRows.empty(s.n_kv_heads, s.head_dim, s.full_dtype)
        self.f_ids = np.zeros(0, dtype=np.int64)
        self.f_mass = np.zeros(0, dtype=np.float32)
        self.n_seen = 0

    # -- the quantized store's layout (lm_cache.PolicyKVCache keeps keys transposed) ---------
    def empty_store(self) -> QuantStore:
        return QuantStore.empty(self.shape.n_kv_heads, self.shape.head_dim, self.fmt)

    def _store_append(self, k: mx.array, v: mx.array) -> QuantStore:
        return quantize_append(self.store, k, v, self.fmt)

    def _store_groups(self, groups: np.ndarray) -> QuantStore:
        g = self.fmt.group_size
        slots = (groups[:, None] * g + np.arange(g)[None, :]).reshape(-1)
        s_idx, g_idx = mx.array(slots.astype(np.int32)), mx.array(groups.astype(np.int32))
        st = self.store
        return QuantStore(st.k_codes[:, s_idx], st.k_scales[:, g_idx], st.k_mins[:, g_idx],
                          st.v_codes[:, s_idx], st.v_scales[:, s_idx], st.v_mins[:, s_idx])

    # -- what it holds ------------------------------------------------------------
    @property
    def n_kept(self) -> int:
        return len(self.q_ids) + len(self.f_ids)

    @property
    def k_full(self) -> mx.array:
        """(Hkv, Nf, D) the held full-precision keys (a view of the buffer: not to keep past a step)."""
        return self.full.keys()

    @property
    def v_full(self) -> mx.array:
        return self.full.values()

    def nbytes(self) -> int:
        """Bytes of what is held: ``kvcache.cost.kv_bytes``."""
        return self.full.nbytes() + (self.store.nbytes() if self.store.n_tokens else 0)

    def allocated_bytes(self) -> int:
        """Bytes allocated: ``nbytes`` plus the full-precision buffers' spare rows (full_rows.py)."""
        return self.full.allocated() + (self.store.nbytes() if self.store.n_tokens else 0)

    def kept_ids(self) -> np.ndarray:
        return np.sort(np.concatenate([self.q_ids, self.f_ids]))

    def _positions(self) -> mx.array:
        ids = np.concatenate([self.q_ids, self.f_ids])
        ranks = np.empty(len(ids), dtype=np.int32)
        ranks[np.argsort(ids, kind="stable")] = np.arange(len(ids), dtype=np.int32)
        return mx.array(ranks)

    def _view(self) -> QuantizedKV:
        st = self.store
        return QuantizedKV(st.k_codes, st.k_scales, st.k_mins, st.v_codes, st.v_scales, st.v_mins,
                           self.k_full, self.v_full, self._positions())

    # -- the one call attention makes -----------------------------------------------
    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """q (Hq, L, D), k/v (Hkv, L, D), all before RoPE. Appends the L tokens and attends each
        query exactly as decoding them one at a time would (kvcache/chunk_view.py), then
        quantizes aged groups and evicts. Returns (Hq, L, D) float32.

        Where nothing ages or leaves before the last query, one causal attention over the cache
        and the chunk; under heavy hitters, sub-steps between the points where decoding would
        evict (which units stay depends on the attention mass up to each eviction); otherwise
        each query masked to what decoding would show it (``_attend_chunk``)."""
        length = q.shape[1]
        if self.track_mass:
            parts, done = [], 0
            while done < length:
                r = chunk_view.substep_length(self.policy, self.n_seen, length - done)
                step = slice(done, done + r)
                parts.append(self._attend_plain(q[:, step], k[:, step], v[:, step], scale))
                self._age_and_evict()
                done += r
            return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
        if chunk_view.appends_only(self.policy, self.n_seen, length, self.window_kept):
            out = self._attend_plain(q, k, v, scale)
        else:
            out = self._attend_chunk(q, k, v, scale)
        self._age_and_evict()
        return out

    def _append(self, k: mx.array, v: mx.array) -> None:
        length = k.shape[1]
        dtype = self.shape.full_dtype
        self.full = self.full.append(k.astype(dtype), v.astype(dtype), self.full_step)
        self.f_ids = np.concatenate([self.f_ids, np.arange(self.n_seen, self.n_seen + length)])
        self.f_mass = np.concatenate([self.f_mass, np.zeros(length, dtype=np.float32)])
        self.n_seen += length
        if self.window_kept:
            self._evict(self.n_seen - length + 1)  # what even the step's first query cannot see

    def _age_and_evict(self) -> None:
        if self.quantizes:
            self._quantize_aged(self.n_seen)
        if self.policy.evicts:
            self._evict(self.n_seen)

    def _attend_plain(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Tokens whose queries see the cache as it stands plus the earlier of them (a decode
        step, or a chunk within ``chunk_view.appends_only``): one causal attention. Accumulates
        attention mass where it is tracked."""
        length = q.shape[1]
        self._append(k, v)
        first = self.n_kept - length
        q_pos = mx.arange(first, first + length, dtype=mx.int32)
        q_rot = rope_at(q, q_pos, self.inv_freq, self.shape.traditional_rope)
        kv = self._view()
        masked = self.model_window is not None and self.n_kept > self.model_window  # the mask can hide a key
        if length == 1 and not masked:
            params = DecodeParams(self.fmt, first, scale, self.shape.traditional_rope)
            out, scores, lse = decode_attention(q_rot[:, 0], kv, self.inv_freq, params)
            out = out[:, None]
            received = mx.sum(mx.exp(scores - lse[:, None]), axis=0) if self.track_mass else None
        else:
            window = self.model_window if masked else None
            out, received = chunk_attention(q_rot, kv, q_pos, self.inv_freq, self.fmt, scale,
                                            self.shape.traditional_rope, window=window, sinks=self.policy.sinks)
        if self.track_mass:
            got = np.array(received.astype(mx.float32))
            nq = len(self.q_ids)
            self.q_mass = self.q_mass + got[:nq]
            self.f_mass = self.f_mass + got[nq:]
        return out

    def _attend_chunk(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """A chunk whose queries see different caches (no heavy hitters): the store ages to what
        the last query sees, the groups that aged on the way are attended in both forms, and
        each query is masked to what decoding would show it (``kvcache.chunk_view``)."""
        length = q.shape[1]
        n_first = self.n_seen
        self._append(k, v)
        last = n_first + length - 1  # the stream the last query's cache has aged at
        aged_k = aged_v = None
        aged_ids = np.zeros(0, dtype=np.int64)
        if self.quantizes:
            p, g = self.policy, self.fmt.group_size
            group = (self.f_ids - p.sinks) // g
            ages = (self.f_ids >= p.sinks + self.head * g) & ((group + 1) * g <= last - p.sinks - p.residual)
            if ages.any():
                idx = mx.array(np.flatnonzero(ages).astype(np.int32))
                aged_k, aged_v, aged_ids = self.k_full[:, idx], self.v_full[:, idx], self.f_ids[ages]
            self._quantize_aged(last)
        keys, values = dense_keys_values(self._view(), self.fmt)  # quantized slots first, then full
        if aged_k is not None:
            keys = mx.concatenate([keys, aged_k.astype(mx.float32)], axis=1)
            values = mx.concatenate([values, aged_v.astype(mx.float32)], axis=1)
        key_index = np.concatenate([self.q_ids, self.f_ids, aged_ids])
        quantized = np.arange(len(key_index)) < len(self.q_ids)
        view = chunk_view.chunk_view(self.policy, np.arange(n_first, n_first + length), key_index, quantized,
                                     evicts_first=self.window_kept, model_window=self.model_window)
        return view_attention(q, keys, values, view, self.inv_freq, scale, self.shape.traditional_rope)

    # -- undoing a step (a forward that raised part way through the layers) ------------------
    def snapshot(self) -> tuple:
        """The whole state. Every update rebinds these attributes to new objects (the store and the
        numpy index/mass arrays are never written in place; the full-precision rows are written in
        place only after the rows a ``FullRows`` holds: full_rows.py), so holding them is a copy."""
        return (self.store, self.q_ids, self.q_mass, self.full, self.f_ids, self.f_mass, self.n_seen)

    def restore(self, state: tuple) -> None:
        self.store, self.q_ids, self.q_mass, full, self.f_ids, self.f_mass, self.n_seen = state
        self.full = full.restored()

    # -- rolling back to a prefix (a chat turn that rewrites the last answer) ------------
    def can_truncate(self, n: int) -> bool:
        """True when keeping only the first ``n`` streamed tokens is exact: nothing evicted yet
        and the quantized groups are those a stream of ``n`` tokens forms (kvcache's rule)."""
        if n in (0, self.n_seen):
            return True
        if not 0 < n < self.n_seen or self.n_kept != self.n_seen:
            return False
        return eviction.held_counts(self.policy, n).quant_groups * self.fmt.group_size == len(self.q_ids)

    def truncate(self, n: int) -> None:
        if not self.can_truncate(n):
            raise ValueError(f"cannot roll this cache back to {n} tokens")
        if n == 0:
            self.reset()
            return
        self._keep_full(np.flatnonzero(self.f_ids < n))
        self.n_seen = n

    def _keep_full(self, keep: np.ndarray) -> None:
        if len(keep) == len(self.f_ids):
            return
        self.full = self.full.taken(mx.array(keep.astype(np.int32)))
        self.f_ids, self.f_mass = self.f_ids[keep], self.f_mass[keep]

    # -- quantization as tokens age (rule 2) ---------------------------------------------
    def _quantize_aged(self, n_seen: int) -> None:
        """Quantize the groups aged out of the residual after ``n_seen`` tokens of the stream."""
        p, g = self.policy, self.fmt.group_size
        main = np.flatnonzero(self.f_ids >= p.sinks + self.head * g)  # after the sinks and the head, in stream order
        if not len(main):
            return
        m = max(0, n_seen - p.sinks)
        first = int(self.f_ids[main[0]]) - p.sinks  # aligned: the next group to form starts here
        n = max(0, (m - p.residual - first) // g) * g
        if not n:
            return
        take = main[:n]
        idx = mx.array(take.astype(np.int32))
        self.store = self._store_append(self.full.k[:, idx], self.full.v[:, idx])
        self.q_ids = np.concatenate([self.q_ids, self.f_ids[take]])
        self.q_mass = np.concatenate([self.q_mass, self.f_mass[take]])
        self._keep_full(np.setdiff1d(np.arange(len(self.f_ids)), take))

    # -- eviction (rules 3 and 4) -----------------------------------------------------------
    def _evict(self, n_seen: int) -> None:
        """Apply the window as it stands after ``n_seen`` tokens of the stream."""
        p, g = self.policy, self.fmt.group_size
        edge = max(0, n_seen - p.sinks) - p.window  # a unit whose newest main index < edge leaves
        out = np.flatnonzero((self.f_ids >= p.sinks) & (self.f_ids - p.sinks < edge))
        if len(out):
            budget = 0 if self.quantizes else self.heavy_units
            drop = np.setdiff1d(out, out[_heaviest(self.f_mass[out], budget)])
            self._keep_full(np.setdiff1d(np.arange(len(self.f_ids)), drop))
        if len(self.q_ids):
            newest = self.q_ids.reshape(-1, g)[:, -1]
            out = np.flatnonzero(newest - p.sinks < edge)
            if len(out):
                mass = self.q_mass.reshape(-1, g)[out].sum(-1)
                drop = np.setdiff1d(out, out[_heaviest(mass, self.heavy_units)])
                if len(drop):
                    self._keep_groups(np.setdiff1d(np.arange(len(newest)), drop))

    def _keep_groups(self, groups: np.ndarray) -> None:
        g = self.fmt.group_size
        slots = (groups[:, None] * g + np.arange(g)[None, :]).reshape(-1)
        self.store = self._store_groups(groups)
        self.q_ids, self.q_mass = self.q_ids[slots], self.q_mass[slots]


def _heaviest(scores: np.ndarray, budget: int) -> np.ndarray:
    """Indices of the ``budget`` largest scores; ties keep the newer (later) unit."""
    if budget <= 0 or not len(scores):
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((-np.arange(len(scores)), -scores))
    return order[:budget]


class ModelCache:
    """The caches of every layer, and what the UI reads: bytes, tokens held, tokens evicted."""
    kind = "page"  # keys before RoPE (backends/mlx/lm_cache.py holds them rotated)
    store_layout = ""  # lm_cache.LMCache keeps the quantized keys transposed (named in prompt cache files)
    position_limit = None  # keys are re-indexed at their in-cache positions: a window streams on

    def __init__(self, policy: KVPolicy, n_layers: int, shape: CacheShape, inv_freq: mx.array | list[mx.array],
                 layer_windows: tuple[int | None, ...] = ()):
        """``inv_freq``: one RoPE table, or one per layer; ``layer_windows``: the model's own
        sliding window per layer (None: full attention), empty for none."""
        self.policy = policy
        freqs = inv_freq if isinstance(inv_freq, list) else [inv_freq] * n_layers
        windows = tuple(layer_windows) or (None,) * n_layers
        self.layers = [LayerCache(policy, shape, f, w) for f, w in zip(freqs, windows)]

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def chunk_length(self, n: int) -> int:
        """Tokens of the next ``n`` one forward pass takes: all (a layer attends a chunk exactly)."""
        return n

    def stepped(self, n: int) -> None:
        """The layers counted the step's tokens themselves."""

    @property
    def n_seen(self) -> int:
        return self.layers[0].n_seen

    @property
    def n_kept(self) -> int:
        """Tokens held by the layer that holds the most (a model's sliding layers hold fewer)."""
        return max(layer.n_kept for layer in self.layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def allocated(self) -> tuple[int, int]:
        """(tokens the stream reaches before a buffer has to grow, bytes the buffers take now)."""
        spare = min(layer.full.capacity - layer.full.n for layer in self.layers)
        return self.n_seen + spare, self.allocated_bytes()

    def snapshot(self) -> list[tuple]:
        return [layer.snapshot() for layer in self.layers]

    def restore(self, states: list[tuple]) -> None:
        """Every layer back to ``snapshot()``'s state, whichever layers a failed step had reached."""
        for layer, state in zip(self.layers, states):
            layer.restore(state)

    def truncate(self, n: int) -> bool:
        """Roll every layer back to the first ``n`` tokens when that is exact; False otherwise."""
        if not all(layer.can_truncate(n) for layer in self.layers):
            return False
        for layer in self.layers:
            layer.truncate(n)
        return True

    def arrays(self) -> list[mx.array]:
        """Every array the caches hold (to evaluate them with the step's logits)."""
        return [a for layer in self.layers for a in (layer.full.k, layer.full.v, *layer.store.arrays())]

    def probe(self) -> tuple[int, int, int]:
        """(kv bytes, tokens held, tokens evicted) for backends.streaming.KVProbe."""
        return self.nbytes(), self.n_kept, self.n_seen - self.n_kept
