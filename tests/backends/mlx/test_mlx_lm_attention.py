"""Attention from the quantized codes (backends/mlx/lm_attention.py) against dequantize-then-attend,
and its routing inside mlx-lm's models (backends/mlx/lm_cache.py)."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX model zoo needs mlx-lm (pip install 'mlx-lm[cpu]' on Linux)")

from localctx.backends.mlx import lm_attention, lm_cache  # noqa: E402
from localctx.backends.mlx.lm_attention import HeldKV  # noqa: E402
from localctx.kernels_metal.quant import (QuantFormat, dequantize_keys, dequantize_values, quantize_keys,  # noqa: E402
                                         quantize_values, unpack)
from test_mlx_backend import tiny_folder, tiny_session  # noqa: E402,F401  (tiny_folder is a fixture)

D = 64


def reference(q, keys, values, scale, visible):
    """float64 numpy attention: q (Hq, L, D), keys/values (Hkv, N, D), visible (L, N) bool."""
    hq, hkv = q.shape[0], keys.shape[0]
    k = np.repeat(keys, hq // hkv, axis=0).astype(np.float64)
    v = np.repeat(values, hq // hkv, axis=0).astype(np.float64)
    s = np.einsum("hld,hnd->hln", q.astype(np.float64), k) * scale
    s = np.where(visible[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hln,hnd->hld", w, v)


def held_cache(hkv, n_q, n_f, fmt, seed):
    """A held cache of ``n_q`` quantized tokens then ``n_f`` full-precision ones, and its dense
    keys/values as kvcache/quant.py's format dequantizes them."""
    rng = np.random.default_rng(seed)
    k = mx.array(rng.normal(size=(hkv, n_q + n_f, D)).astype(np.float32) * 2)
    v = mx.array(rng.normal(size=(hkv, n_q + n_f, D)).astype(np.float32))
    store = lm_attention.empty_store(hkv, D, fmt)
    if n_q:
        store = lm_attention.quantize_append(store, k[:, :n_q], v[:, :n_q], fmt)
    k_full, v_full = k[:, n_q:].astype(mx.float16), v[:, n_q:].astype(mx.float16)
    dense_k, dense_v = [k_full.astype(mx.float32)], [v_full.astype(mx.float32)]
    if n_q:
        codes, scales, mins = quantize_keys(k[:, :n_q], fmt)
        dense_k.insert(0, dequantize_keys(codes, scales, mins, fmt))
        dense_v.insert(0, dequantize_values(store.v_codes, store.v_scales, store.v_mins, fmt))
    held = HeldKV(store, k_full, v_full, fmt)
    return held, np.array(mx.concatenate(dense_k, axis=1)), np.array(mx.concatenate(dense_v, axis=1))


CASES = [  # bits, group, Hq, Hkv, quantized tokens, full tokens, queries
    (4, 32, 9, 3, 96, 31, 1), (8, 32, 9, 3, 96, 31, 1), (4, 64, 4, 4, 128, 5, 1), (8, 64, 8, 2, 64, 0, 1),
    (4, 32, 9, 3, 64, 40, 7), (8, 32, 6, 2, 32, 17, 17), (4, 32, 4, 1, 160, 0, 1), (16, 32, 9, 3, 0, 50, 1),
    (16, 32, 9, 3, 0, 50, 6),
]


@pytest.mark.parametrize("bits,g,hq,hkv,n_q,n_f,length,mask_kind", [
    (*case, kind) for case in CASES for kind in ("none", "causal", "bool", "additive")
    if kind != "none" or case[-1] == 1])  # a chunk always comes with a mask
def test_codes_attend_as_the_dequantized_cache_does(bits, g, hq, hkv, n_q, n_f, length, mask_kind):
    fmt = QuantFormat(bits if bits < 16 else 8, g)
    held, keys, values = held_cache(hkv, n_q, n_f, fmt, seed=bits + g + hq + n_q + length)
    n = n_q + n_f
    rng = np.random.default_rng(n + length)
    q = rng.normal(size=(hq, length, D)).astype(np.float32)
    visible = np.arange(n - length, n)[:, None] >= np.arange(n)[None]  # causal, the chunk last
    mask = None if mask_kind == "none" else "causal"
    if mask_kind in ("bool", "additive"):
        visible = visible & (rng.random((length, n)) > 0.3)
        visible[:, -1] |= np.arange(length) == length - 1  # every query sees at least one key
        visible[np.arange(length), n - length + np.arange(length)] = True
        mask = mx.array(visible) if mask_kind == "bool" else mx.array(np.where(visible, 0.0, -1e30).astype(np.float32))
    scale = D ** -0.5
    out = lm_attention.attention(mx.array(q)[None], held, scale, mask)
    assert out.shape == (1, hq, length, D) and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out[0]), reference(q, keys, values, scale, visible), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_transposed_keys_are_kvcache_quants_codes(bits):
    fmt = QuantFormat(bits, 32)
    k = mx.random.normal((3, 96, D), key=mx.random.key(bits))
    store = lm_attention.quantize_append(lm_attention.empty_store(3, D, fmt), k, k, fmt)
    codes, scales, mins = quantize_keys(k, fmt)
    assert np.array_equal(np.array(unpack(store.k_codes, bits)), np.array(unpack(codes, bits)).swapaxes(-1, -2))
    assert np.array_equal(np.array(store.k_scales), np.array(scales).swapaxes(-1, -2))
    assert np.array_equal(np.array(store.k_mins), np.array(mins).swapaxes(-1, -2))
    assert store.nbytes() == sum(a.nbytes for a in (codes, scales, mins, *quantize_values(k, fmt)))
    # keeping groups 0 and 2 is quantizing those groups alone
    kept = lm_attention.keep_groups(store, mx.array([0, 2]), fmt)
    alone = lm_attention.quantize_append(lm_attention.empty_store(3, D, fmt),
                                         mx.concatenate([k[:, :32], k[:, 64:]], axis=1),
                                         mx.concatenate([k[:, :32], k[:, 64:]], axis=1), fmt)
    for a, b in zip(kept.arrays(), alone.arrays()):
        assert np.array_equal(np.array(a), np.array(b))
    assert np.allclose(np.array(lm_attention.dense_keys(kept, fmt)),
                       np.array(dequantize_keys(*quantize_keys(mx.concatenate([k[:, :32], k[:, 64:]], axis=1), fmt), fmt)))


def test_an_mlx_lm_model_attends_from_the_codes_with_the_dense_logits(tiny_folder, monkeypatch):  # noqa: F811
    """int4 inside an mlx-lm model: every layer's attention goes through lm_attention (the routing),
    and the logits are those of attending over the dequantized keys and values."""
    session, _ = tiny_session(tiny_folder, "int4+g32", graph="mlx-lm")
    ids = session.tokenizer.encode("the cache keeps sinks and a window of recent tokens " * 6)[:100]
    calls = []
    real = lm_attention.attention
    monkeypatch.setattr(lm_attention, "attention", lambda *a: calls.append(a[1].n_quantized) or real(*a))
    routed = [session.feed(ids[:70])] + [session.feed([t]) for t in ids[70:]]
    assert max(calls) > 0 and len(calls) >= len(session.cache.layers) * (1 + len(ids) - 70)
    monkeypatch.setattr(lm_cache.PolicyKVCache, "attend", lambda self, q, scale, mask: dense_attend(self.held, q, scale, mask))
    session.reset()
    dense = [session.feed(ids[:70])] + [session.feed([t]) for t in ids[70:]]
    for a, b in zip(routed, dense):
        np.testing.assert_allclose(a, b, atol=1e-4)


def dense_attend(held, queries, scale, mask):
    k, v = held.dense()
    return mx.fast.scaled_dot_product_attention(queries, k[None], v[None], scale=scale, mask=mask)


def test_a_routed_layer_builds_its_quantized_keys_dense_once_per_store(tiny_folder, monkeypatch):  # noqa: F811
    """Where attend() takes every step, update_and_fetch's dense keys and values (for a model that
    attends on its own) reuse one graph of the quantized store until a group is quantized, instead of
    building it at every step (Python work for a graph never computed: docs/benchmarks-mlx.md)."""
    session, _ = tiny_session(tiny_folder, "int4+g32", graph="mlx-lm")
    built = []
    real = HeldKV.dense_store
    monkeypatch.setattr(HeldKV, "dense_store", lambda self: built.append(self.store) or real(self))
    ids = session.tokenizer.encode("the cache keeps sinks and a window of recent tokens " * 30)[:170]
    assert len(ids) == 170
    layers = session.cache.layers
    session.feed(ids[:70])
    replaced = 0
    for t in ids[70:]:
        before = layers[0].store
        session.feed([t])
        replaced += layers[0].store is not before  # a group was quantized in this step
        for layer in layers:  # none keeps a store it replaced this step past the step
            assert layer._store_dense is None or layer._store_dense[0] is layer.store
    assert replaced >= 2
    assert not any(layer.attends_itself for layer in layers)
    stores = {id(s) for s in built}
    assert len(built) == len(stores)  # each store's dense graph built once
    assert len(built) <= len(layers) * (1 + replaced + 1) < len(layers) * (170 - 70)


def test_a_model_that_attends_on_its_own_gets_the_held_keys_fresh_at_every_step(tiny_folder, monkeypatch):  # noqa: F811
    """A model whose attention does not come to attend() uses what update_and_fetch returns: the
    dequantized keys and values, exact; its layers find that out after the first step and keep no
    dense copy of their store."""
    import sys
    session, _ = tiny_session(tiny_folder, "int4+g32", graph="mlx-lm")
    ids = session.tokenizer.encode("the cache keeps sinks and a window of recent tokens " * 30)[:170]
    routed = [session.feed(ids[:70])] + [session.feed([t]) for t in ids[70:]]
    module = sys.modules[type(session.model.model).__module__]

    def own_attention(queries, keys, values, cache, scale, mask, sinks=None):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    monkeypatch.setattr(module, "scaled_dot_product_attention", own_attention)
    session.reset()
    own = [session.feed(ids[:70])] + [session.feed([t]) for t in ids[70:]]
    assert all(layer.attends_itself and layer._store_dense is None for layer in session.cache.layers)
    for a, b in zip(routed, own):
        np.testing.assert_allclose(a, b, atol=1e-4)
