"""localctx's KV policies inside mlx-lm's models, through the cache object those models already call
(``cache.offset`` for RoPE, ``cache.make_mask``, ``cache.update_and_fetch(keys, values)`` then
attention over what it returns) — no model file is forked.

``PolicyKVCache`` is a policy_cache.LayerCache (the same stores and rules: full-precision sinks and
residual, groups quantized as they age with per-channel keys, a window, bytes equal to
``kvcache.cost.kv_bytes``) whose keys arrive already rotated: mlx-lm applies RoPE at the stream
position ``offset`` before the cache sees a key. So a window keeps stream positions (as mlx-lm's
RotatingKVCache does) and cannot re-index them past the trained context, and heavy hitters are not
offered: mlx-lm's attention (``mx.fast.scaled_dot_product_attention``) returns no attention weights
to rank tokens by. ``zoo.refusals`` says so before a plan is made. The models' attention
(``scaled_dot_product_attention``, imported by each model module from ``mlx_lm.models.base``) is
pointed at ``_routed_attention`` (``route_attention``), which over this cache attends straight from
the quantized codes (lm_attention.py); ``update_and_fetch`` still hands back the held keys and values
dequantized, for a model that attends on its own. A chunk is exact when nothing ages or leaves inside
it, which ``LMCache.chunk_length`` keeps true (the session feeds at most that many tokens at a time).

``NativeCache`` runs an architecture on mlx-lm's own caches (``model.make_cache()``: sliding-window or
recurrent layers), at full precision only."""
from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

from localctx.backends.mlx import lm_attention
from localctx.backends.mlx.lm_attention import HeldKV
from localctx.backends.mlx.policy_cache import CacheShape, LayerCache, ModelCache
from localctx.kernels_metal.quant_append import QuantStore
from localctx.kvcache import chunk_view
from localctx.kvcache.policy import KVPolicy


class PolicyKVCache(LayerCache):
    def __init__(self, policy: KVPolicy, shape: CacheShape):
        super().__init__(policy, shape, mx.zeros((shape.head_dim // 2,), mx.float32))
        self.held: HeldKV | None = None  # what the step's attention sees (set by update_and_fetch)
        # the model attends on its own over what update_and_fetch returns (a step ended without attend)
        self.attends_itself = False
        self._store_dense: tuple[QuantStore, mx.array, mx.array] | None = None  # (store, its keys, values)

    # the store keeps keys transposed, as mx.quantized_matmul reads them (lm_attention.py)
    def empty_store(self) -> QuantStore:
        return lm_attention.empty_store(self.shape.n_kv_heads, self.shape.head_dim, self.fmt)

    def _store_append(self, k: mx.array, v: mx.array) -> QuantStore:
        return lm_attention.quantize_append(self.store, k, v, self.fmt)

    def _store_groups(self, groups: np.ndarray) -> QuantStore:
        return lm_attention.keep_groups(self.store, mx.array(groups.astype(np.int32)), self.fmt)

    @property
    def offset(self) -> int:
        """The stream position of the next token (where mlx-lm rotates it)."""
        return self.n_seen

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("a localctx policy cache does not run a model's own sliding window")
        if n == 1 and not return_array:
            return None
        if not return_array:
            return "causal"
        kept = self.n_kept  # keys before the chunk; the chunk's own follow them in order
        return mx.arange(kept, kept + n)[:, None] >= mx.arange(kept + n)[None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys/values (1, Hkv, L, D), rotated. Keeps what the step's attention sees in ``held``
        (``attend`` reads it, from the codes) and returns every held key and value (1, Hkv, N, D)
        dequantized, the chunk's own last and in order, for a model that attends on its own: MLX is
        lazy, so where ``attend`` runs instead they are never computed."""
        dtype = keys.dtype
        if self.held is not None:  # the last step's attention did not come to attend()
            self.attends_itself, self._store_dense = True, None
        self.held = None  # no view of the buffers may live across the write (full_rows.py)
        self._append(keys[0], values[0])
        self.held = HeldKV(self.store, self.k_full, self.v_full, self.fmt)
        self._age_and_evict()
        k, v = self.held.dense(None if self.attends_itself else self._quantized_dense(self.held))
        return k[None].astype(dtype), v[None].astype(dtype)

    def _quantized_dense(self, held: HeldKV) -> tuple[mx.array, mx.array] | None:
        """The quantized store's dense keys and values, built once per store (it changes when a group
        is quantized, every group_size tokens), not at every step: where attend() takes the step they
        are never computed, yet building their graph is Python work (30 layers' cache step at 160 tokens:
        12.8 ms against 17.9 built every step, docs/benchmarks-mlx.md). A model that attends on its own instead
        (found after its first step) has them built afresh at each step, so it holds no dense copy."""
        if not held.n_quantized:
            return None
        if self._store_dense is None or self._store_dense[0] is not held.store:
            self._store_dense = (held.store, *held.dense_store())
        return self._store_dense[1:]

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        """Attention of ``queries`` (B, Hq, L, D) over what the last ``update_and_fetch`` held
        (let go here: the step's graph keeps what it needs, the cache no more than its bytes)."""
        held, self.held = self.held, None
        if self._store_dense is not None and self._store_dense[0] is not self.store:
            self._store_dense = None  # a group was quantized this step: the old store goes with the step
        return lm_attention.attention(queries, held, scale, mask)

    @property
    def state(self) -> list[mx.array]:
        return [self.k_full, self.v_full, *self.store.arrays()]


def _routed_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's ``scaled_dot_product_attention``, except over a localctx policy cache: there the
    cache attends from its codes."""
    if isinstance(cache, PolicyKVCache) and sinks is None:
        return cache.attend(queries, scale, mask)
    return _mlx_lm_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def route_attention() -> None:
    """Point every loaded mlx-lm model module's ``scaled_dot_product_attention`` (imported from
    ``mlx_lm.models.base``) at ``_routed_attention``; other caches still reach mlx-lm's own."""
    global _mlx_lm_attention
    from mlx_lm.models import base

    if _mlx_lm_attention is None:
        _mlx_lm_attention = base.scaled_dot_product_attention
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _mlx_lm_attention:
            module.scaled_dot_product_attention = _routed_attention


_mlx_lm_attention = None


class LMCache(ModelCache):
    """Every layer's PolicyKVCache; what the session and the UI read, as for the page caches."""
    kind = "mlx-lm"
    store_layout = "keys-by-token"  # the prompt cache's files say so (keys transposed since this tag)

    def __init__(self, policy: KVPolicy, n_layers: int, shape: CacheShape, position_limit: int):
        """``position_limit``: the trained context; keys keep stream positions, so a window streams
        only that far."""
        self.policy = policy
        self.position_limit = position_limit
        self.layers = [PolicyKVCache(policy, shape) for _ in range(n_layers)]
        route_attention()

    def chunk_length(self, n: int) -> int:
        """Tokens of the next ``n`` one forward pass takes exactly (nothing ages or leaves inside)."""
        return chunk_view.substep_length(self.policy, self.n_seen, n)

    def stepped(self, n: int) -> None:
        """The layers counted the step's tokens themselves."""


class NativeCache:
    """mlx-lm's own caches for the model (sliding layers, recurrent state): fp16 KV only, exactly
    mlx-lm's behaviour; no prompt cache on disk. A failed step restarts it."""
    kind = "mlx-lm native"

    def __init__(self, model, position_limit: int):
        self.model = model
        self.position_limit = position_limit
        self.reset()

    def reset(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.layers = make_prompt_cache(self.model)
        self.n_seen = 0

    def chunk_length(self, n: int) -> int:
        return n

    def stepped(self, n: int) -> None:
        self.n_seen += n

    @property
    def n_kept(self) -> int:
        return max((c.size() for c in self.layers), default=0)

    def nbytes(self) -> int:
        """Bytes of what the layers hold: the rows in use (not the spare rows their buffers grow by), in
        the dtype the model computes in (float32 on a CPU, where the cost model's fp16 count is half)."""
        return sum(_held_bytes(c) for c in self.layers)

    def allocated(self) -> tuple[int, int]:
        """(tokens the stream reaches before a buffer has to grow, bytes the buffers take now)."""
        spare = [n for n in (_spare_rows(c) for c in self.layers) if n is not None]
        return (self.n_seen + min(spare) if spare else self.position_limit), sum(c.nbytes for c in self.layers)

    def snapshot(self):
        return None

    def restore(self, state) -> None:
        self.reset()

    def truncate(self, n: int) -> bool:
        if n == self.n_seen:
            return True
        if n == 0:
            self.reset()
            return True
        if not all(c.is_trimmable() for c in self.layers) or self.n_kept != self.n_seen:
            return False
        for c in self.layers:
            c.trim(self.n_seen - n)
        self.n_seen = n
        return True

    def arrays(self) -> list[mx.array]:
        from mlx.utils import tree_flatten

        return [a for c in self.layers for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]

    def probe(self) -> tuple[int, int, int]:
        return self.nbytes(), self.n_kept, self.n_seen - self.n_kept


def _held_bytes(layer) -> int:
    """Bytes of the rows an mlx-lm cache holds; a recurrent layer's state is held whole."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if not isinstance(layer, KVCache | RotatingKVCache):
        return layer.nbytes
    if layer.keys is None:
        return 0
    k, v = layer.keys, layer.values  # (batch, heads, rows, dim)
    return layer.size() * (k.shape[1] * k.shape[3] * k.dtype.size + v.shape[1] * v.shape[3] * v.dtype.size)


def _spare_rows(layer) -> int | None:
    """Rows an mlx-lm cache's buffers hold beyond what is in use (0: the next token grows them); None
    for a layer that never grows: a full sliding window rotates in place, a recurrent state keeps its size."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if isinstance(layer, RotatingKVCache) and layer.size() >= layer.max_size:
        return None
    if not isinstance(layer, KVCache | RotatingKVCache):
        return None
    return 0 if layer.keys is None else int(layer.keys.shape[2]) - layer.size()
