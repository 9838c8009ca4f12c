"""MLX's chunked prefill attends exactly as decoding the same tokens one at a time (the MLX
counterpart of tests/kvcache/test_kv_prefill.py): for every policy family (quantized with a residual and
the unbounded cache's head group, sinks + window, heavy hitters, a model's own sliding window,
combinations) the outputs of chunks of 7, 64 and everything at once equal token-by-token
decode's, and the cache holds the same tokens, codes and bytes afterwards; then the same on tiny
Llama and Gemma 3 models (logits)."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends.mlx.policy_cache import CacheShape, LayerCache, ModelCache  # noqa: E402
from localctx.kernels_metal.rope import inv_frequencies  # noqa: E402
from localctx.kvcache import cost  # noqa: E402
from localctx.kvcache.errors import UserError  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402
from localctx.kvcache.model_spec import ModelSpec  # noqa: E402

H, HKV, D, N = 4, 2, 32, 120
POLICIES = ["int8", "int4+res16", "int4+g32+sink3+res40", "fp16+win40", "fp16+sink4+win40", "int4+sink4+win64",
            "int8+res16+sink2+win64", "int4+res16+win40", "fp16+sink4+win40+heavy8", "int8+sink2+win64+heavy32"]
CASES = ([(p, None) for p in POLICIES]  # and a model's own window, larger and smaller than the policy's
         + [(p, 48) for p in ("int4+sink4+win64", "fp16", "int8+res16", "fp16+sink4+win40+heavy8")]
         + [(p, 20) for p in ("int4+res16+win40", "int8+sink2+win64+heavy32", "fp16+sink4+win40")])
CHUNKINGS = [[7], [64], [N], [37, 1, 1, 90]]
SHAPE = CacheShape(HKV, D, mx.float16, traditional_rope=True)
ONE_LAYER = ModelSpec("one", "llama", n_layers=1, n_heads=H, n_kv_heads=HKV, head_dim=D, hidden_size=H * D,
                      vocab_size=64, context_length=4096)


def stream(text: str, chunks: list[int], model_window: int | None = None):
    """Random q/k/v for N tokens (the same whatever the chunking) through one layer, in steps of
    ``chunks`` (repeated)."""
    rng = np.random.default_rng(0)
    qs, ks, vs = (mx.array(rng.standard_normal((h, N, D)).astype(np.float32)) for h in (H, HKV, HKV))
    cache = LayerCache(KVPolicy.parse(text), SHAPE, inv_frequencies(D, 10000.0), model_window)
    outs, n, i = [], 0, 0
    while n < N:
        T = min(chunks[i % len(chunks)], N - n)
        i += 1
        outs.append(cache.attend(qs[:, n:n + T], ks[:, n:n + T], vs[:, n:n + T], D ** -0.5))
        n += T
    return np.array(mx.concatenate(outs, axis=1)), cache


def state(cache: LayerCache) -> list:
    """What the layer holds: stream indices (quantized, full precision), codes and scales, bytes."""
    return [cache.nbytes(), cache.n_seen, cache.q_ids.tolist(), cache.f_ids.tolist(),
            *(np.array(a).tolist() for a in (*cache.store.arrays(), cache.k_full, cache.v_full))]


@pytest.mark.parametrize("text,window", CASES)
def test_a_chunk_attends_as_decoding_does(text, window):
    decoded, ref = stream(text, [1], window)
    for chunks in CHUNKINGS:
        out, cache = stream(text, chunks, window)
        np.testing.assert_allclose(out, decoded, atol=2e-5, err_msg=f"{text} in chunks {chunks}")
        assert state(cache) == state(ref), f"{text} in chunks {chunks} holds another cache"
        assert cache.nbytes() == cost.kv_bytes(ONE_LAYER, cache.policy, N)


def test_a_chunk_where_nothing_ages_or_leaves_keeps_the_causal_path(monkeypatch):
    """One causal attention where nothing ages or leaves before a chunk's last query; the
    per-query view only where it must (int4+res16+sink4+win64, as tests/kvcache/test_kv_prefill.py)."""
    from localctx.backends.mlx import policy_cache as cache_module
    calls = []
    for name in ("chunk_attention", "view_attention"):
        real = getattr(cache_module, name)
        monkeypatch.setattr(cache_module, name, lambda *a, _real=real, _name=name, **kw:
                            calls.append((_name, a[0].shape[1])) or _real(*a, **kw))
    rng = np.random.default_rng(1)
    cache = LayerCache(KVPolicy.parse("int4+res16+sink4+win64"), SHAPE, inv_frequencies(D, 10000.0))
    for T in [20, 1, 1, 30, 40, 1, 30, 1]:
        q, k, v = (mx.array(rng.standard_normal((h, T, D)).astype(np.float32)) for h in (H, HKV, HKV))
        cache.attend(q, k, v, D ** -0.5)
    # 20, then 30 after 22: nothing ages or leaves before their last query (causal); 40 after 52:
    # two groups age (masked per query); 30 after 93: the window moves (masked); single tokens decode
    assert calls == [("chunk_attention", 20), ("chunk_attention", 30), ("view_attention", 40),
                     ("view_attention", 30)]


def test_a_key_value_split_is_refused_with_the_reason():
    """MLX holds keys and values at one precision: k8v4 is refused (UserError) rather than run."""
    with pytest.raises(UserError, match="keys and values at one precision"):
        LayerCache(KVPolicy.parse("k8v4+res16"), SHAPE, inv_frequencies(D, 10000.0))


# -- the same on models: logits of chunked prefill equal token-by-token decode's -------------------
IDS = [(i * 37 + 11) % 64 for i in range(100)]


@pytest.fixture(scope="module")
def llama():
    from localctx.backends.mlx.llama import Model, ModelArgs

    mx.random.seed(3)
    model = Model(ModelArgs(hidden_size=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32,
                            intermediate_size=128, vocab_size=64, traditional_rope=True))
    mx.eval(model.parameters())
    return model, [inv_frequencies(32, 10000.0)] * 2, ()


@pytest.fixture(scope="module")
def gemma():
    from gemma3_tiny import (EPS, FFN, GLOBAL_BASE, HEAD_DIM, HIDDEN, LOCAL_BASE, N_HEADS, N_KV, N_LAYERS,
                             QUERY_SCALE, VOCAB, tiny_tensors)
    from localctx.backends.mlx import gemma3

    windows = tuple(None if (i + 1) % 3 == 0 else 40 for i in range(N_LAYERS))  # windows a group can age in
    args = gemma3.ModelArgs(hidden_size=HIDDEN, n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV,
                            head_dim=HEAD_DIM, intermediate_size=FFN, vocab_size=VOCAB, layer_windows=windows,
                            query_scale=QUERY_SCALE, rms_eps=EPS, rope_base=GLOBAL_BASE, local_rope_base=LOCAL_BASE)
    model = gemma3.build(args, {gemma3._gguf_name(k): mx.array(v) for k, v in tiny_tensors().items()}, mx.float32)
    return model, args.inv_freqs(), windows


def model_logits(built, text: str, chunk: int, ids: list[int]):
    model, inv_freqs, windows = built
    a = model.args
    cache = ModelCache(KVPolicy.parse(text), a.n_layers, CacheShape(a.n_kv_heads, a.head_dim, mx.float32,
                                                                    a.traditional_rope), inv_freqs, windows)
    outs = []
    for start in range(0, len(ids), chunk):
        logits = model(mx.array(ids[start:start + chunk], dtype=mx.int32), cache, last_only=False)
        mx.eval(logits, *cache.arrays())
        outs.append(np.array(logits))
    return np.concatenate(outs), cache


def _held(cache: ModelCache) -> list:
    return [(layer.q_ids.tolist(), layer.f_ids.tolist()) for layer in cache.layers] + [cache.nbytes()]


@pytest.mark.parametrize("text", ["int4+res16", "fp16+sink4+win40", "int8+sink2+win64+heavy32"])
def test_a_models_chunked_prefill_gives_decodings_logits(llama, text):
    decoded, ref = model_logits(llama, text, 1, IDS)
    for chunk in (7, 64, len(IDS)):
        logits, cache = model_logits(llama, text, chunk, IDS)
        np.testing.assert_allclose(logits, decoded, atol=1e-4, err_msg=f"{text}, chunk {chunk}")
        assert _held(cache) == _held(ref)


@pytest.mark.parametrize("text", ["int4", "int8+sink2+win24", "fp16+sink2+win16+heavy4"])
def test_a_sliding_models_chunked_prefill_gives_decodings_logits(gemma, text):
    ids = IDS[:60]  # past the 40-token windows: groups age in them and leave
    decoded, ref = model_logits(gemma, text, 1, ids)
    for chunk in (7, 64, len(ids)):
        logits, cache = model_logits(gemma, text, chunk, ids)
        np.testing.assert_allclose(logits, decoded, atol=1e-4, err_msg=f"{text}, chunk {chunk}")
        assert _held(cache) == _held(ref)
