"""Loading into the MLX graph: a tiny random Llama written as an HF folder and as a GGUF
(llama.cpp's Q/K permutation, traditional RoPE), GGUF Q4_0 / Q4_1 / Q8_0 kept quantized
losslessly, MLX-quantized folders, and the errors a user can fix."""
import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
gguf = pytest.importorskip("gguf")

from localctx.backends.mlx.policy_cache import CacheShape, ModelCache  # noqa: E402
from localctx.backends.mlx.loading import LoadOptions, load_folder, load_gguf  # noqa: E402
from localctx.kvcache.errors import UserError  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 128, 96, 2
Q = gguf.GGMLQuantizationType


CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": FFN,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS,
          "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
          "torch_dtype": "float32"}


def _hf_weights(seed=0, config=None) -> dict:
    c = config or CONFIG
    hidden, ffn, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": 1 + w(hidden),
           "lm_head.weight": w(vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
                    p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                    p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                    p + "mlp.gate_proj.weight": w(ffn, hidden), p + "mlp.up_proj.weight": w(ffn, hidden),
                    p + "mlp.down_proj.weight": w(hidden, ffn), p + "input_layernorm.weight": 1 + w(hidden),
                    p + "post_attention_layernorm.weight": 1 + w(hidden)})
    return out


def write_hf_folder(folder, weights=None, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    config = config or CONFIG
    weights = weights or _hf_weights(config=config)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion of HF Q/K rows: rotate-half pairs become adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, weights, qtypes: dict | None = None):
    """HF weights → a llama GGUF; ``qtypes`` maps a GGUF tensor name prefix to a quant type."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tensors = {"token_embd.weight": weights["model.embed_tokens.weight"],
               "output_norm.weight": weights["model.norm.weight"], "output.weight": weights["lm_head.weight"]}
    for i in range(LAYERS):
        for hf, gg in _GGUF_NAMES.items():
            t = weights[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, HEADS)
            elif gg == "attn_k":
                t = _permute(t, KV_HEADS)
            tensors[f"blk.{i}.{gg}.weight"] = t
    for name, t in tensors.items():
        qtype = next((q for prefix, q in (qtypes or {}).items() if name.startswith(prefix)), None)
        if qtype is None or t.ndim == 1:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(loaded, tokens, policy=KVPolicy()):
    a = loaded.model.args
    cache = ModelCache(policy, a.n_layers, CacheShape(a.n_kv_heads, a.head_dim, mx.float32, a.traditional_rope),
                       loaded.inv_freq)
    return np.array(loaded.model(mx.array(tokens), cache, last_only=False))


def test_gguf_with_permuted_qk_gives_the_hf_logits(tmp_path):
    weights = _hf_weights()
    hf, _cfg = load_folder(write_hf_folder(tmp_path / "hf", weights))
    gg, _meta = load_gguf(write_gguf(tmp_path / "m.gguf", weights))
    assert gg.model.args.traditional_rope and not hf.model.args.traditional_rope
    tokens = [3, 17, 5, 88, 41, 2, 9, 60]
    np.testing.assert_allclose(_logits(gg, tokens), _logits(hf, tokens), atol=1e-4)


def test_hf_logits_change_with_rope_layout(tmp_path):
    """The permutation matters: treating the GGUF's Q/K as rotate-half breaks the match."""
    weights = _hf_weights()
    hf, _ = load_folder(write_hf_folder(tmp_path / "hf", weights))
    gg, _ = load_gguf(write_gguf(tmp_path / "m.gguf", weights))
    wrong = type(gg.model.args)(**{**gg.model.args.__dict__, "traditional_rope": False})
    a = wrong
    cache = ModelCache(KVPolicy(), a.n_layers, CacheShape(a.n_kv_heads, a.head_dim, mx.float32, False), gg.inv_freq)
    bad = np.array(gg.model(mx.array([3, 17, 5, 88, 41]), cache, last_only=False))
    assert np.abs(bad - _logits(hf, [3, 17, 5, 88, 41])).max() > 1e-3


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_quantized_tensors_stay_quantized_and_lossless(tmp_path, qtype):
    weights = _hf_weights()
    path = write_gguf(tmp_path / "q.gguf", weights, {"blk.": qtype, "token_embd": qtype})
    loaded, _ = load_gguf(path, LoadOptions(dequantize=False))
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    layer = loaded.model.model.layers[1]
    for module, name in ((layer.mlp.down_proj, "blk.1.ffn_down.weight"), (layer.self_attn.v_proj, "blk.1.attn_v.weight"),
                         (loaded.model.model.embed_tokens, "token_embd.weight")):
        assert module.bits == (8 if qtype == Q.Q8_0 else 4) and module.group_size == 32
        mine = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
        want = gguf.quants.dequantize(raw[name].data, qtype).reshape(mine.shape)
        np.testing.assert_allclose(np.array(mine), want, rtol=0, atol=1e-6)
    expanded, _ = load_gguf(path, LoadOptions(dequantize=True))
    tokens = [1, 2, 3, 50, 7]
    np.testing.assert_allclose(_logits(loaded, tokens), _logits(expanded, tokens), atol=1e-4)


def test_mlx_quantized_folder_loads_its_per_layer_config(tmp_path):
    weights = {k: mx.array(v) for k, v in _hf_weights().items()}
    packed = {}
    for k, v in weights.items():
        if k.endswith("proj.weight"):
            bits = 8 if "down_proj" in k else 4
            w, s, b = mx.quantize(v, group_size=32, bits=bits)
            base = k[: -len(".weight")]
            packed.update({f"{base}.weight": w, f"{base}.scales": s, f"{base}.biases": b})
        else:
            packed[k] = v
    quant = {"group_size": 32, "bits": 4}
    quant.update({f"model.layers.{i}.mlp.down_proj": {"group_size": 32, "bits": 8} for i in range(LAYERS)})
    folder = tmp_path / "mlxq"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), packed)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "quantization": quant}))
    loaded, _ = load_folder(folder, LoadOptions(dequantize=False))
    assert loaded.model.model.layers[0].mlp.down_proj.bits == 8
    assert loaded.model.model.layers[0].mlp.up_proj.bits == 4
    dense, _ = load_folder(folder, LoadOptions(dequantize=True))
    np.testing.assert_allclose(_logits(loaded, [4, 5, 6]), _logits(dense, [4, 5, 6]), atol=1e-4)


def test_unknown_gguf_tensor_is_a_user_error(tmp_path):
    weights = _hf_weights()
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_head_count(HEADS)
    w.add_embedding_length(HIDDEN)
    w.add_tensor("blk.0.ssm_conv1d.weight", weights["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="ssm_conv1d"):
        load_gguf(path)


def test_unsupported_rope_scaling_is_a_user_error(tmp_path):
    folder = write_hf_folder(tmp_path / "yarn", config={**CONFIG, "rope_scaling": {"type": "yarn", "factor": 4}})
    with pytest.raises(UserError, match="yarn"):
        load_folder(folder)


def test_llama3_rope_scaling_slows_only_the_low_frequencies(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    plain, _ = load_folder(write_hf_folder(tmp_path / "a"))
    scaled, _ = load_folder(write_hf_folder(tmp_path / "b", config={**CONFIG, "rope_scaling": scaling}))
    ratio = np.array(plain.inv_freq) / np.array(scaled.inv_freq)
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(8.0)
    assert np.all(np.diff(ratio) >= -1e-6)
