"""localctx's KV policies inside mlx-lm's models, through the cache object those models already call
(``cache.offset`` for RoPE, ``cache.make_mask``, ``cache.update_and_fetch(keys, values)`` then
attention over what it returns) — no model file is forked.

``PolicyKVCache`` is a policy_cache.LayerCache (the same stores and rules: full-precision sinks and
residual, groups quantized as they age with per-channel keys, a window, bytes equal to
``kvcache.cost.kv_bytes``) whose keys arrive already rotated: mlx-lm applies RoPE at the stream
position ``offset`` before the cache sees a key. So a window keeps stream positions (as mlx-lm's
RotatingKVCache does) and cannot re-index them past the trained context, and heavy hitters are not
offered: mlx-lm's attention (``mx.fast.scaled_dot_product_attention``) returns no attention weights
to rank tokens by. ``zoo.refusals`` says so before a plan is made. ``update_and_fetch`` hands back
the held keys and values dequantized; a chunk is exact when nothing ages or leaves inside it, which
``LMCache.chunk_length`` keeps true (the session feeds at most that many tokens at a time).

``NativeCache`` runs an architecture on mlx-lm's own caches (``model.make_cache()``: sliding-window or
recurrent layers), at full precision only."""
from __future__ import annotations

import mlx.core as mx

from localctx.backends.mlx.policy_cache import CacheShape, LayerCache, ModelCache
from localctx.kernels_metal.decode_attention import QuantizedKV, dense_keys_values
from localctx.kvcache import chunk_view
from localctx.kvcache.policy import KVPolicy


class PolicyKVCache(LayerCache):
    def __init__(self, policy: KVPolicy, shape: CacheShape):
        super().__init__(policy, shape, mx.zeros((shape.head_dim // 2,), mx.float32))

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
        """keys/values (1, Hkv, L, D), rotated; returns every held key and value (1, Hkv, N, D),
        the chunk's own last and in order (what mlx-lm's causal mask expects)."""
        dtype = keys.dtype
        self._append(keys[0], values[0])
        st = self.store
        view = QuantizedKV(st.k_codes, st.k_scales, st.k_mins, st.v_codes, st.v_scales, st.v_mins,
                           self.k_full, self.v_full, None)
        k, v = dense_keys_values(view, self.fmt)
        self._age_and_evict()
        return k[None].astype(dtype), v[None].astype(dtype)

    @property
    def state(self) -> list[mx.array]:
        return [self.k_full, self.v_full, *self.store.arrays()]


class LMCache(ModelCache):
    """Every layer's PolicyKVCache; what the session and the UI read, as for the page caches."""
    kind = "mlx-lm"

    def __init__(self, policy: KVPolicy, n_layers: int, shape: CacheShape, position_limit: int):
        """``position_limit``: the trained context; keys keep stream positions, so a window streams
        only that far."""
        self.policy = policy
        self.position_limit = position_limit
        self.layers = [PolicyKVCache(policy, shape) for _ in range(n_layers)]

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
        return sum(c.nbytes for c in self.layers)

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
