"""The MLX policy caches against the plain reference cache and the cost model (tiny shapes)."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends.mlx.cache import CacheShape, LayerCache  # noqa: E402
from localctx.backends.mlx.reference_cache import ReferenceLayerCache  # noqa: E402
from localctx.kernels_metal.rope import inv_frequencies  # noqa: E402
from localctx.kvcache import cost  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402
from localctx.kvcache.spec import ModelSpec  # noqa: E402

H_Q, H_KV, D = 4, 2, 64
SPEC = ModelSpec(name="tiny", architecture="llama", n_layers=1, n_heads=H_Q, n_kv_heads=H_KV, head_dim=D,
                 hidden_size=H_Q * D, vocab_size=10, context_length=4096)
SHAPE = CacheShape(H_KV, D, mx.float16, traditional_rope=True)
CHUNKS = [5, 1, 1, 37, 1, 1, 1, 20] + [1] * 12 + [30] + [1] * 8  # prefill chunks and decode steps

EXACT = ["fp16", "int8", "int4", "int4+res16", "int8+g64+res8", "fp16+sink4+win24", "fp16+win30",
         "fp16+sink2+win16+heavy8"]
COMBOS = ["int8+sink4+win40", "int4+res8+sink4+win48+heavy8", "int4+g64+win70", "int8+res16+sink4+win33+heavy5"]


def _stream(policy: KVPolicy, seed: int = 0):
    rng = np.random.default_rng(seed)
    inv = inv_frequencies(D, 10000.0)
    fast, ref = LayerCache(policy, SHAPE, inv), ReferenceLayerCache(policy, SHAPE, inv)
    for n in CHUNKS:
        q, k, v = (mx.array(rng.standard_normal((h, n, D)).astype(np.float32)) for h in (H_Q, H_KV, H_KV))
        out_fast = np.array(fast.attend(q, k, v, D ** -0.5))
        out_ref = np.array(ref.attend(q, k, v, D ** -0.5))
        yield fast, ref, out_fast, out_ref


@pytest.mark.parametrize("text", EXACT + COMBOS)
def test_bytes_equal_cost_model_at_every_step(text):
    policy = KVPolicy.parse(text)
    for fast, _ref, _a, _b in _stream(policy):
        assert fast.nbytes() == cost.kv_bytes(SPEC, policy, fast.n_seen)
        assert fast.n_kept == policy.kept_tokens(fast.n_seen)


@pytest.mark.parametrize("text", EXACT + COMBOS)
def test_kept_tokens_are_sinks_window_and_heavy_hitters(text):
    policy = KVPolicy.parse(text)
    for fast, ref, _a, _b in _stream(policy):
        kept = fast.kept_ids()
        np.testing.assert_array_equal(kept, ref.kept_ids())
        if policy.window is not None:
            n = fast.n_seen
            assert set(range(min(policy.sinks, n))) <= set(kept.tolist())
            assert set(range(max(0, n - policy.window), n)) <= set(kept.tolist())


@pytest.mark.parametrize("text", EXACT)
def test_attention_equals_reference(text):
    for _fast, _ref, out_fast, out_ref in _stream(KVPolicy.parse(text)):
        np.testing.assert_allclose(out_fast, out_ref, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("text", COMBOS)
def test_quantized_eviction_stays_within_quantization_noise(text):
    """Quantized + evicting: the fast cache refills holes and regroups tokens, so it matches the
    reference within the noise of the format, and is far closer than to a wrong answer."""
    policy = KVPolicy.parse(text)
    tol = 0.02 if policy.bits == 8 else 0.25
    for _fast, _ref, out_fast, out_ref in _stream(policy):
        assert np.abs(out_fast - out_ref).mean() < tol


def _filled_cache(newcomer_scale: float):
    """int8+win40: 32 wide tokens quantized, 8 + 1 tokens of ``newcomer_scale``; token 0 is
    evicted and token 32 (the oldest full-precision one) takes its slot."""
    cache = LayerCache(KVPolicy.parse("int8+win40"), SHAPE, inv_frequencies(D, 10000.0))
    rng = np.random.default_rng(3)
    block = lambda n, s: mx.array((rng.standard_normal((H_KV, n, D)) * s).astype(np.float32))  # noqa: E731
    cache.attend(mx.zeros((H_Q, 32, D)), block(32, 4.0), block(32, 4.0), 0.1)
    newcomers = block(8, newcomer_scale)
    cache.attend(mx.zeros((H_Q, 8, D)), newcomers, newcomers, 0.1)
    before = (np.array(cache.store.k_codes), cache.q_ids.copy())
    one = block(1, newcomer_scale)
    cache.attend(mx.zeros((H_Q, 1, D)), one, one, 0.1)
    return cache, before, np.array(newcomers[:, 0])


def test_hole_fill_keeps_other_members_codes_when_newcomer_fits():
    cache, (codes_before, ids_before), _ = _filled_cache(0.1)
    hole = int(np.flatnonzero(ids_before == 0)[0])
    assert cache.q_ids[hole] == 32
    others = [i for i in range(len(ids_before)) if i != hole]
    np.testing.assert_array_equal(np.array(cache.store.k_codes)[:, others], codes_before[:, others])


def test_hole_fill_widens_the_group_for_an_outlier():
    cache, (_codes, ids_before), newcomer = _filled_cache(40.0)
    from localctx.kernels_metal.quant import dequantize_keys
    hole = int(np.flatnonzero(ids_before == 0)[0])
    st = cache.store
    dense = np.array(dequantize_keys(st.k_codes, st.k_scales, st.k_mins, cache.fmt))
    step = np.array(st.k_scales[:, 0].astype(mx.float32))
    assert np.all(np.abs(dense[:, hole] - newcomer.astype(np.float16)) <= step * 0.51 + 1e-3)


def test_reset_forgets_everything():
    policy = KVPolicy.parse("int4+sink4+win40")
    cache = LayerCache(policy, SHAPE, inv_frequencies(D, 10000.0))
    cache.attend(mx.zeros((H_Q, 70, D)), mx.ones((H_KV, 70, D)), mx.ones((H_KV, 70, D)), 0.1)
    cache.reset()
    assert cache.n_kept == 0 and cache.nbytes() == 0 and cache.n_seen == 0
