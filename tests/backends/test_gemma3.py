"""Gemma 3 in the torch and MLX engines on a tiny random-weight model: the torch page against an
independent numpy forward (sliding local layers, per-layer RoPE bases, QK-norm, query scaling,
scaled embeddings, GeGLU, pre/post norms), through every kind of KV cache the factory builds,
prefill in chunks and decode alike; MLX against torch; and the model's own sliding windows
composed with KV policies: what a query on a sliding layer can see, and what each layer holds."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch")

from gemma3_tiny import HEAD_DIM, N_KV, WINDOW, layer_windows, reference_logits, tiny_tensors, torch_model  # noqa: E402
from localctx.backends.torch.engine import Engine, EngineOptions  # noqa: E402
from localctx.backends.torch.rope import Rope  # noqa: E402
from localctx.kvcache.factory import CacheRequest, make_kv_cache  # noqa: E402
from localctx.kvcache.policy import KVPolicy, layer_policy  # noqa: E402
from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache  # noqa: E402

TOKENS = [5, 17, 3, 42, 8, 8, 60, 1, 33, 21, 9, 14, 50, 2, 27, 11]  # 16 tokens: 4 windows of 4


@pytest.fixture(scope="module")
def tiny():
    tensors = tiny_tensors()
    return tensors, torch_model(tensors), reference_logits(tensors, TOKENS)


def _engine(model, policy: str, chunk: int) -> Engine:
    c = model.config
    req = CacheRequest(c.n_layers, c.n_kv_heads, c.head_dim, capacity_tokens=256,
                       layer_windows=model.layer_windows())
    cache = make_kv_cache(KVPolicy.parse(policy), req, model.make_rope())
    return Engine(model, cache, EngineOptions(prefill_chunk=chunk))


@pytest.mark.parametrize("chunk", [16, 5, 1])
def test_torch_page_matches_the_numpy_reference(tiny, chunk):
    _, model, ref = tiny
    engine = _engine(model, "fp16", chunk)
    engine.cache.add_sequence(0)
    got = engine.prefill(0, TOKENS, all_logits=True).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_torch_decode_matches_the_numpy_reference(tiny):
    _, model, ref = tiny
    engine = _engine(model, "fp16", 16)
    engine.cache.add_sequence(0)
    engine.prefill(0, TOKENS[:6])
    for i in range(6, len(TOKENS)):
        got = engine.decode([0], [TOKENS[i]])[0].numpy()
        np.testing.assert_allclose(got, ref[i], rtol=1e-4, atol=1e-4)


def test_sliding_layers_hold_only_their_window(tiny):
    _, model, _ = tiny
    engine = _engine(model, "fp16", 5)
    engine.cache.add_sequence(0)
    engine.prefill(0, TOKENS)
    held = [layer.n_tokens for layer in engine.cache._seqs[0].layers]
    assert held == [WINDOW if w else len(TOKENS) for w in layer_windows()]
    per_token = 2 * N_KV * HEAD_DIM * 4  # fp32 K and V of one token in one layer
    assert engine.cache.kv_bytes(0) == sum(held) * per_token
    assert engine.cache.kv_tokens(0) == len(TOKENS) and engine.cache.evicted_tokens(0) == 0


def test_quantized_policy_composes_with_the_sliding_layers(tiny):
    """int8 KV: the sliding layers (window 4, shorter than a group) keep their window in full
    precision, the global layer quantizes aged groups; before any group ages the logits are exact."""
    _, model, ref = tiny
    engine = _engine(model, "int8", 16)
    engine.cache.add_sequence(0)
    got = engine.prefill(0, TOKENS * 5, all_logits=True).numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:len(TOKENS)], ref, rtol=1e-4, atol=1e-4)
    layers = engine.cache._seqs[0].layers
    assert [layer.n_groups > 0 for layer in layers] == [w is None for w in layer_windows()]
    assert [layer.n_tokens for layer in layers] == [WINDOW if w else 5 * len(TOKENS) for w in layer_windows()]


def test_layer_policy_takes_the_smaller_window():
    p = KVPolicy.parse("int8+sink4+win4096+heavy8")
    assert layer_policy(p, None) == p
    assert layer_policy(p, 512) == KVPolicy.parse("int8+win512")  # the model's window: no sinks, no heavy
    small = KVPolicy.parse("fp16+sink4+win256")
    assert layer_policy(small, 512) == small  # the policy's window is smaller: it applies as it is
    assert layer_policy(KVPolicy(), 512) == KVPolicy.parse("fp16+win512")


# -- what a query on a sliding layer sees ------------------------------------------------------
D = 32  # one value channel per token: the output shows which tokens a query attended to


def _visibility_cache(policy: str, window: int | None) -> PolicyKVCache:
    shape = PolicyCacheShape(1, 1, D, torch.float32, capacity_tokens=256)
    return PolicyKVCache(shape, KVPolicy.parse(policy), Rope(D, 10000.0), layer_windows=(window,))


def _seen(cache: PolicyKVCache, first: int, n: int) -> list[set[int]]:
    """Feed tokens first..first+n-1 with zero queries and keys (uniform attention over what is
    visible) and value e_j for token j: the nonzero channels of each output are what it saw."""
    q = torch.zeros(1, n, 1, D)
    v = torch.zeros(1, n, 1, D)
    for t in range(n):
        v[0, t, 0, first + t] = 1.0
    cache.begin_step([0], n)
    out = cache.attend(0, q, torch.zeros(1, n, 1, D), v)
    cache.end_step()
    return [set(np.flatnonzero(out[0, t, 0].numpy() > 1e-6).tolist()) for t in range(n)]


def test_a_query_on_a_sliding_layer_sees_only_its_window():
    cache = _visibility_cache("fp16", WINDOW)
    cache.add_sequence(0)
    for p, seen in enumerate(_seen(cache, 0, 10)):  # one prefill chunk longer than the window
        assert seen == set(range(max(0, p - WINDOW + 1), p + 1))
    for p in range(10, 14):  # then decode
        assert _seen(cache, p, 1) == [set(range(p - WINDOW + 1, p + 1))]
        assert cache.kv_tokens(0) == WINDOW


def test_a_global_layer_sees_everything():
    cache = _visibility_cache("fp16", None)
    cache.add_sequence(0)
    assert _seen(cache, 0, 10)[-1] == set(range(10))


def test_a_smaller_policy_window_applies_on_top():
    """Policy sink1+win2 on a layer whose own window is 4: the policy's smaller window rules
    (sinks included), and no query ever sees past the model's window in the main stream."""
    cache = _visibility_cache("fp16+sink1+win2", WINDOW)
    cache.add_sequence(0)
    _seen(cache, 0, 6)
    for p in range(6, 12):
        (seen,) = _seen(cache, p, 1)
        assert seen == {0, p - 2, p - 1, p}  # the sink, the 2 the policy kept, the new token
        assert cache.kv_tokens(0) == 3


def test_a_larger_policy_window_does_not_widen_the_layer():
    cache = _visibility_cache("fp16+sink2+win8", WINDOW)
    cache.add_sequence(0)
    for p, seen in enumerate(_seen(cache, 0, 12)):
        assert seen == set(range(max(0, p - WINDOW + 1), p + 1))  # no sinks either: the model has none there


def test_rope_per_layer_is_checked_against_the_layer_count():
    shape = PolicyCacheShape(2, 1, D, torch.float32)
    with pytest.raises(ValueError):
        PolicyKVCache(shape, KVPolicy(), [Rope(D, 10000.0)] * 3)


# -- MLX --------------------------------------------------------------------------------------
def _mlx_logits(policy: str, chunks: list[int], tensors):
    mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
    from gemma3_tiny import mlx_model

    from localctx.backends.mlx.policy_cache import CacheShape, ModelCache

    model = mlx_model(tensors)
    a = model.args
    cache = ModelCache(KVPolicy.parse(policy), a.n_layers, CacheShape(a.n_kv_heads, a.head_dim, mx.float32, False),
                       a.inv_freqs(), a.layer_windows)
    out, start = [], 0
    for n in chunks:
        logits = model(mx.array(TOKENS[start:start + n], dtype=mx.int32), cache, last_only=False)
        out.append(np.array(logits))
        start += n
    return np.concatenate(out), cache


@pytest.mark.parametrize("chunks", [[16], [5, 5, 6], [6] + [1] * 10])
def test_mlx_page_matches_the_reference(tiny, chunks):
    tensors, _, ref = tiny
    got, cache = _mlx_logits("fp16", chunks, tensors)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert [layer.n_kept for layer in cache.layers] == [WINDOW if w else len(TOKENS) for w in layer_windows()]


@pytest.fixture(scope="module")
def torch_windowed_logits(tiny) -> np.ndarray:
    """torch: a 6-token prefill (which attends as decoding does) then 10 decode steps."""
    engine = _engine(tiny[1], "fp16+sink1+win3", 6)
    engine.cache.add_sequence(0)
    want = [engine.prefill(0, TOKENS[:6], all_logits=True).numpy()]
    want += [engine.decode([0], [t]).numpy() for t in TOKENS[6:]]
    return np.concatenate(want)


@pytest.mark.parametrize("chunks", [[6] + [1] * 10, [5, 5, 6], [16]])
def test_mlx_chunked_prefill_matches_torch_under_a_windowed_policy(tiny, torch_windowed_logits, chunks):
    """MLX's chunks attend as decoding does (backends/mlx/policy_cache.py, tests/backends/mlx/test_mlx_prefill.py):
    whatever the chunking, torch's logits."""
    got, _ = _mlx_logits("fp16+sink1+win3", chunks, tiny[0])
    np.testing.assert_allclose(got, torch_windowed_logits, rtol=1e-4, atol=1e-4)


def _hf_folder(tmp_path, tensors):
    """The tiny model as a Gemma3ForCausalLM folder: HF names, norms stored as weight (not 1 + weight)."""
    import json

    from safetensors.numpy import save_file

    import gemma3_tiny as g
    from localctx.backends.torch.gemma3 import hf_name, is_norm

    # the names transformers' Gemma3ForCausalLM writes (tied embeddings: no lm_head)
    per_layer = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    names += [f"model.layers.{i}.{t}.weight" for i in range(g.N_LAYERS) for t in per_layer]
    hf = {hf_name(n): n for n in names}
    assert len(hf) == len(names) and set(hf) == set(tensors)  # each HF name reads one of the model's tensors
    out = {hf[name]: value - 1.0 if is_norm(name) else value for name, value in tensors.items()}
    save_file(out, str(tmp_path / "model.safetensors"))
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": g.HIDDEN,
              "num_hidden_layers": g.N_LAYERS, "num_attention_heads": g.N_HEADS, "num_key_value_heads": g.N_KV,
              "head_dim": g.HEAD_DIM, "intermediate_size": g.FFN, "vocab_size": g.VOCAB, "rms_norm_eps": g.EPS,
              "rope_theta": g.GLOBAL_BASE, "rope_local_base_freq": g.LOCAL_BASE, "sliding_window": g.WINDOW,
              "layer_types": ["full_attention" if w is None else "sliding_attention" for w in layer_windows()],
              "query_pre_attn_scalar": 12, "max_position_embeddings": 1024, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_hf_folder_loads_into_both_pages(tiny, tmp_path):
    from localctx.backends.torch import gemma3
    from localctx.backends.torch.config import BuildOptions

    tensors, _, ref = tiny
    folder = _hf_folder(tmp_path, tensors)
    model, spec = gemma3.from_hf(folder, "tiny", BuildOptions(torch.float32, torch.float32, "cpu", "dense"))
    assert spec.architecture == "gemma3" and model.layer_windows() == layer_windows()
    engine = _engine(model, "fp16", 16)
    engine.cache.add_sequence(0)
    np.testing.assert_allclose(engine.prefill(0, TOKENS, all_logits=True).numpy(), ref, rtol=1e-4, atol=1e-4)
    mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
    from localctx.backends.mlx.policy_cache import CacheShape, ModelCache
    from localctx.backends.mlx.loading import load_folder

    loaded, _ = load_folder(folder)
    a = loaded.model.args
    cache = ModelCache(KVPolicy(), a.n_layers, CacheShape(a.n_kv_heads, a.head_dim, mx.float32, False),
                       loaded.inv_freq, loaded.layer_windows)
    got = np.array(loaded.model(mx.array(TOKENS, dtype=mx.int32), cache, last_only=False))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["fp16", "int8", "int4+sink2+win64"])
def test_a_sequence_of_sliding_and_global_layers_exports_and_imports_what_it_holds(policy):
    """A prompt-cache file, or a cache grown into a larger one: the sliding layers hold their window
    and the global layer every token (or the policy's window), so each group of layers is written with
    its own rows and window start; the copy then attends as the original."""
    from kv_helpers import attend_step, random_steps

    L, H, HKV, D_ = 6, 2, 1, 32
    windows = (16, 16, 16, 16, 16, None)
    shape = PolicyCacheShape(L, HKV, D_, torch.float32, capacity_tokens=1024)
    make = lambda: PolicyKVCache(shape, KVPolicy.parse(policy), Rope(D_, 10000.0), layer_windows=windows)
    source, copy = make(), make()
    step, run = random_steps(3, L, H, HKV, D_), attend_step
    source.add_sequence(0)
    for T in (70, 1, 40, 1):
        run(source, step(T))
    held = [layer.n_tokens for layer in source._seqs[0].layers]
    assert held[0] < held[-1]  # the layers hold different rows: one stacked tensor could not carry them
    copy.import_sequence(0, source.export_sequence(0))
    assert [layer.n_tokens for layer in copy._seqs[0].layers] == held
    assert copy.kv_bytes(0) == source.kv_bytes(0) and copy.kv_tokens(0) == source.kv_tokens(0)
    for _ in range(3):
        nxt = step(1)
        for a, b in zip(run(source, nxt), run(copy, nxt)):
            assert torch.equal(a, b)
