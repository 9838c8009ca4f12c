"""The MLX backend's side of the prompt cache on disk (``kvcache/prompt_cache_file.py``): every layer's
cache in its own format (backends/mlx/policy_cache.py) — the full-precision keys and values before RoPE,
the quantized store's packed codes, scales and minimums as held — and read back into a fresh
``ModelCache``, so a quantized cache stays quantized and a window keeps its stream positions.

Per layer ``i`` the tensors are ``{i}.k_full``, ``{i}.v_full`` and, once groups are quantized,
``{i}.k_codes`` ... ``{i}.v_mins``. Stream indices are written only where they do not follow from
the counts (``{i}.f_ids`` / ``{i}.q_ids`` once a window has evicted tokens; without eviction the
quantized groups are one run starting at ``{i}.q_start``), and attention mass only where a layer
tracks it for heavy hitters, so an fp16 or int4 file is the cost model's KV bytes plus a header."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from localctx.backends.mlx.full_rows import FullRows
from localctx.backends.mlx.policy_cache import LayerCache, ModelCache
from localctx.kernels_metal.quant_append import QuantStore
from localctx.kvcache.prompt_cache import CacheScope, Hit, PromptCache

_STORE = ("k_codes", "k_scales", "k_mins", "v_codes", "v_scales", "v_mins")


def layout(cache: ModelCache) -> str:
    first = cache.layers[0]
    s = first.shape
    windows = ",".join(str(layer.model_window or 0) for layer in cache.layers)
    kind = f"{cache.kind} {cache.store_layout}" if cache.store_layout else cache.kind
    return (f"mlx {kind}|{str(s.full_dtype).removeprefix('mlx.core.')}|{len(cache.layers)}x{s.n_kv_heads}x{s.head_dim}"
            f"|rope{'-traditional' if s.traditional_rope else ''}|windows {windows}")


def scope(model_hash: str, policy: str, cache: ModelCache) -> CacheScope:
    return CacheScope(model_hash=model_hash, backend="mlx", policy=policy, layout=layout(cache))


def _implied_start(layer: LayerCache) -> int | None:
    """Where the quantized run starts when the stream indices follow from it: every token seen is
    held and the quantized tokens are one run in order (None: the indices must be written)."""
    if layer.n_kept != layer.n_seen:
        return None
    start = int(layer.q_ids[0]) if len(layer.q_ids) else 0
    run = np.arange(start, start + len(layer.q_ids))
    rest = np.setdiff1d(np.arange(layer.n_seen), run)
    return start if np.array_equal(layer.q_ids, run) and np.array_equal(layer.f_ids, rest) else None


def export(cache: ModelCache) -> dict[str, np.ndarray]:
    out = {"n_seen": np.asarray([cache.n_seen], dtype=np.int64)}
    for i, layer in enumerate(cache.layers):
        out[f"{i}.k_full"] = np.array(layer.k_full)
        out[f"{i}.v_full"] = np.array(layer.v_full)
        if len(layer.q_ids):
            out.update({f"{i}.{name}": np.array(a) for name, a in zip(_STORE, layer.store.arrays())})
        start = _implied_start(layer)
        if start is None:
            out[f"{i}.f_ids"] = layer.f_ids.astype(np.int64)
            out[f"{i}.q_ids"] = layer.q_ids.astype(np.int64)
        else:
            out[f"{i}.q_start"] = np.asarray([start], dtype=np.int64)
        if layer.track_mass:
            out[f"{i}.f_mass"], out[f"{i}.q_mass"] = layer.f_mass, layer.q_mass
    return out


def save(store: PromptCache, cache: ModelCache, tokens: list[int]) -> None:
    """Write the cache, which has seen exactly ``tokens``."""
    store.save(tokens, export(cache), {"kv_bytes": str(cache.nbytes())})


def load(cache: ModelCache, hit: Hit) -> None:
    """Make ``cache`` hold what the hit's file holds (a whole file: its ``hit.n_tokens`` tokens).
    Raises ValueError when the file's tensors are not this cache's (the scope says they are)."""
    t = hit.file.tensors
    n_seen = int(t["n_seen"][0])
    if n_seen != hit.n_tokens:
        raise ValueError(f"the file holds {n_seen} tokens, not the {hit.n_tokens} looked up")
    states = []
    for i, layer in enumerate(cache.layers):
        k_full, v_full = mx.array(t[f"{i}.k_full"]), mx.array(t[f"{i}.v_full"])
        if f"{i}.k_codes" in t:
            st = QuantStore(*(mx.array(t[f"{i}.{name}"]) for name in _STORE))
        else:
            st = layer.empty_store()
        n_q, n_f = st.n_tokens, k_full.shape[1]
        if f"{i}.q_start" in t:
            start = int(t[f"{i}.q_start"][0])
            q_ids = np.arange(start, start + n_q)
            f_ids = np.setdiff1d(np.arange(n_seen), q_ids)
        else:
            q_ids, f_ids = t[f"{i}.q_ids"].astype(np.int64), t[f"{i}.f_ids"].astype(np.int64)
        if len(q_ids) != n_q or len(f_ids) != n_f or k_full.shape[0] != layer.shape.n_kv_heads:
            raise ValueError(f"layer {i} of the file does not have this cache's shape")
        q_mass = np.array(t[f"{i}.q_mass"]) if layer.track_mass else np.zeros(n_q, dtype=np.float32)
        f_mass = np.array(t[f"{i}.f_mass"]) if layer.track_mass else np.zeros(n_f, dtype=np.float32)
        states.append((st, q_ids, q_mass, FullRows.of(k_full, v_full), f_ids, f_mass, n_seen))
    cache.restore(states)
