"""The MLX policy caches against the plain reference cache and the cost model (tiny shapes)."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends.mlx.policy_cache import CacheShape, LayerCache  # noqa: E402
from localctx.backends.mlx.reference_cache import ReferenceLayerCache  # noqa: E402
from localctx.kernels_metal.rope import inv_frequencies  # noqa: E402
from localctx.kvcache import cost, eviction  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402
from localctx.kvcache.model_spec import ModelSpec  # noqa: E402

H_Q, H_KV, D = 4, 2, 64
SPEC = ModelSpec(name="tiny", architecture="llama", n_layers=1, n_heads=H_Q, n_kv_heads=H_KV, head_dim=D,
                 hidden_size=H_Q * D, vocab_size=10, context_length=4096)
SHAPE = CacheShape(H_KV, D, mx.float16, traditional_rope=True)
CHUNKS = [5, 1, 1, 37, 1, 1, 1, 20] + [1] * 12 + [30] + [1] * 8 + [70, 1]  # prefill chunks and decode steps

POLICIES = ["fp16", "int8", "int4", "int4+res16", "int8+g64+res8", "fp16+sink4+win24", "fp16+win30",
            "fp16+sink2+win16+heavy8", "int8+sink4+win40", "int4+res8+sink4+win48+heavy8", "int4+g64+win70",
            "int8+res16+sink4+win50+heavy5", "int4+res16+sink4+win20"]  # the last: window too short to quantize


def _stream(policy: KVPolicy, seed: int = 0):
    rng = np.random.default_rng(seed)
    inv = inv_frequencies(D, 10000.0)
    fast, ref = LayerCache(policy, SHAPE, inv), ReferenceLayerCache(policy, SHAPE, inv)
    for n in CHUNKS:
        q, k, v = (mx.array(rng.standard_normal((h, n, D)).astype(np.float32)) for h in (H_Q, H_KV, H_KV))
        out_fast = np.array(fast.attend(q, k, v, D ** -0.5))
        out_ref = np.array(ref.attend(q, k, v, D ** -0.5))
        yield fast, ref, out_fast, out_ref


@pytest.mark.parametrize("text", POLICIES)
def test_bytes_equal_cost_model_at_every_step(text):
    policy = KVPolicy.parse(text)
    for fast, _ref, _a, _b in _stream(policy):
        assert fast.nbytes() == cost.kv_bytes(SPEC, policy, fast.n_seen)
        assert fast.n_kept == eviction.held_counts(policy, fast.n_seen).tokens


@pytest.mark.parametrize("text", POLICIES)
def test_kept_tokens_follow_the_rules(text):
    policy = KVPolicy.parse(text)
    g = policy.group_size
    for fast, ref, _a, _b in _stream(policy):
        kept = fast.kept_ids()
        np.testing.assert_array_equal(kept, ref.kept_ids())
        n = fast.n_seen
        assert set(range(min(policy.sinks, n))) <= set(kept.tolist())
        if policy.window is not None:
            assert set(range(max(policy.sinks, n - policy.window), n)) <= set(kept.tolist())
        if len(fast.q_ids):  # quantized tokens are whole aligned groups of the main stream
            main = fast.q_ids.reshape(-1, g) - policy.sinks
            assert np.all(main[:, 0] % g == 0) and np.all(np.diff(main, axis=1) == 1)
            assert np.all(fast.q_ids >= policy.sinks)


@pytest.mark.parametrize("text", POLICIES)
def test_attention_equals_reference(text):
    for _fast, _ref, out_fast, out_ref in _stream(KVPolicy.parse(text)):
        np.testing.assert_allclose(out_fast, out_ref, atol=2e-4, rtol=1e-3)


def test_quantized_groups_leave_the_window_whole():
    policy = KVPolicy.parse("int8+win40")
    cache = LayerCache(policy, SHAPE, inv_frequencies(D, 10000.0))
    zeros = lambda n: mx.zeros((H_KV, n, D))  # noqa: E731
    cache.attend(mx.zeros((H_Q, 64, D)), zeros(64), zeros(64), 0.1)
    held = []
    for _ in range(40):
        cache.attend(mx.zeros((H_Q, 1, D)), zeros(1), zeros(1), 0.1)
        held.append(cache.n_kept)
    assert min(held) >= 40 and max(held) <= 40 + 31  # the window holds W .. W+g-1 tokens
    assert len(set(held)) > 1


def test_truncate_only_where_exact():
    policy = KVPolicy.parse("int8+res8")
    cache = LayerCache(policy, SHAPE, inv_frequencies(D, 10000.0))
    cache.attend(mx.zeros((H_Q, 80, D)), mx.ones((H_KV, 80, D)), mx.ones((H_KV, 80, D)), 0.1)
    assert cache.q_ids.tolist() == list(range(32, 64))  # tokens 0..31 are the full-precision head
    assert cache.can_truncate(75) and not cache.can_truncate(50)  # 50 tokens never form that group
    cache.truncate(75)
    assert cache.n_seen == 75 and cache.nbytes() == cost.kv_bytes(SPEC, policy, 75)


def test_reset_forgets_everything():
    policy = KVPolicy.parse("int4+sink4+win40")
    cache = LayerCache(policy, SHAPE, inv_frequencies(D, 10000.0))
    cache.attend(mx.zeros((H_Q, 70, D)), mx.ones((H_KV, 70, D)), mx.ones((H_KV, 70, D)), 0.1)
    cache.reset()
    assert cache.n_kept == 0 and cache.nbytes() == 0 and cache.n_seen == 0
