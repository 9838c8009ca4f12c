"""Weights into the MLX model page its architecture names (``MODEL_PAGES``: llama.py for the Llama
family, gemma3.py for Gemma 3). Llama-family GGUFs natively (mx.load keeps Q4_0 / Q4_1 / Q8_0 quantized: each
linear gets its own group size and bits, nothing is dequantised), Hugging Face folders
(safetensors) and MLX folders (safetensors already quantized, ``quantization`` in config.json).
Never pickles."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from localctx.backends.mlx import gemma3
from localctx.backends.mlx import llama
from localctx.backends.mlx.layers import CausalLM
from localctx.backends.mlx.llama import Model, ModelArgs
from localctx.backends.mlx.policy_cache import CacheShape, ModelCache
from localctx.backends.models.gguf_header import GGUFHeader
from localctx.backends.models.gguf_meta import ModelMeta
from localctx.backends.models.spec_reader import read_gguf
from localctx.kernels_metal.rope import inv_frequencies
from localctx.kvcache.errors import UserError
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.policy import KVPolicy

_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|scales|biases|bias)$")
_TOP_NAME = re.compile(r"^(\w+)\.(weight|scales|biases|bias)$")
# llama.cpp rotates adjacent pairs for these (it permuted Q/K at conversion); Qwen uses halves
_GGUF_TRADITIONAL = {"llama", "mistral"}
# the page that builds each architecture (a GGUF's general.architecture, a config.json's model_type)
MODEL_PAGES = {"llama": llama, "mistral": llama, "qwen2": llama, "qwen3": llama,
               "gemma3": gemma3, "gemma3_text": gemma3}


@dataclass
class LoadedModel:
    """A page's model as the session calls a graph (zoo.LMModel is the other kind)."""
    model: CausalLM
    inv_freq: mx.array | list[mx.array]  # one table, or one per layer (layers with different bases)
    layer_windows: tuple[int | None, ...] = ()  # the model's own sliding window per layer; empty: none

    def __call__(self, tokens: mx.array, cache: ModelCache, last_only: bool = True) -> mx.array:
        return self.model(tokens, cache, last_only)

    def make_cache(self, policy: KVPolicy, spec: ModelSpec) -> ModelCache:
        a = self.model.args
        shape = CacheShape(a.n_kv_heads, a.head_dim, mx.float16 if spec.kv_elem_bytes == 2 else mx.float32,
                           a.traditional_rope)
        return ModelCache(policy, a.n_layers, shape, self.inv_freq, self.layer_windows)


@dataclass(frozen=True)
class LoadOptions:
    """``dequantize``: expand quantized weights to the compute dtype at load (exact values; MLX's
    CPU quantized matmul is a scalar loop, so off Metal this is much faster). Default: only
    where Metal is absent."""
    dequantize: bool | None = None

    def wants_dequantize(self) -> bool:
        return (not mx.metal.is_available()) if self.dequantize is None else self.dequantize


def compute_dtype() -> mx.Dtype:
    """float32 on the CPU (exact, and the CPU has no fast half matmul); float16 on Metal."""
    return mx.float16 if mx.metal.is_available() else mx.float32


def _page(architecture, source: str):
    page = MODEL_PAGES.get(str(architecture))
    if page is None:
        raise UserError(f"unsupported architecture {architecture!r} in {source}; --backend mlx runs "
                        f"{', '.join(sorted(MODEL_PAGES))} (use --backend llamacpp for the others)")
    return page


def load_gguf(path: Path, options: LoadOptions = LoadOptions()) -> tuple[LoadedModel, GGUFHeader]:
    """The model and the file's header (its metadata, for the tokenizer)."""
    reader = read_gguf(path)
    meta = ModelMeta(reader, path.name)
    if _page(meta.arch, path.name) is gemma3:
        args = gemma3.args_from_gguf(reader, path.name)
        model = gemma3.build(args, gemma3.gguf_weights(path, reader), compute_dtype())
        return LoadedModel(model, args.inv_freqs(), args.layer_windows), reader
    try:
        tensors = mx.load(str(path))
    except (RuntimeError, ValueError) as exc:
        raise UserError(f"MLX cannot read {path.name} ({str(exc)[:100]}); use a GGUF with F16, Q4_0, Q4_1 or Q8_0 "
                        "tensors, or the model's safetensors folder") from None
    n_heads = int(meta.need("attention.head_count"))
    hidden = int(meta.need("embedding_length"))
    weights, freq_factors = {}, None
    for name, value in tensors.items():
        if name == "rope_freqs.weight":
            freq_factors = value
            continue
        m = _BLOCK_NAME.match(name)
        if m and m.group(2) in _GGUF_BLOCK:
            weights[f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"] = value
            continue
        m = _TOP_NAME.match(name)
        if m and m.group(1) in _GGUF_TOP:
            weights[f"{_GGUF_TOP[m.group(1)]}.{m.group(2)}"] = value
            continue
        raise UserError(f"{path.name} has a tensor {name!r} that the MLX Llama graph does not know; "
                        "this architecture variant is not supported by --backend mlx")
    args = ModelArgs(
        hidden_size=hidden, n_layers=int(meta.need("block_count")), n_heads=n_heads,
        n_kv_heads=int(meta.get("attention.head_count_kv", n_heads)),
        head_dim=int(meta.get("attention.key_length", hidden // n_heads)),
        intermediate_size=int(meta.need("feed_forward_length")),
        vocab_size=int(weights["model.embed_tokens.weight"].shape[0]),
        rms_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(meta.get("rope.freq_base", 10000.0)),
        traditional_rope=meta.arch in _GGUF_TRADITIONAL, tie_embeddings="lm_head.weight" not in weights,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in weights)
    inv_freq = inv_frequencies(args.head_dim, args.rope_base, freq_factors)
    return LoadedModel(_build(args, weights, _quant_from_shapes(args, weights), options), inv_freq), reader


def _in_features(args: ModelArgs, path: str) -> int:
    if path.endswith(("o_proj",)):
        return args.n_heads * args.head_dim
    if path.endswith("down_proj"):
        return args.intermediate_size
    return args.hidden_size


def _quant_from_shapes(args: ModelArgs, weights: dict) -> dict:
    """Per-module {group_size, bits}, read off the packed shapes (GGUF mixes types per tensor)."""
    out = {}
    for key, scales in weights.items():
        if not key.endswith(".scales"):
            continue
        path = key[: -len(".scales")]
        packed = weights[f"{path}.weight"]
        in_features = _in_features(args, path)
        out[path] = {"group_size": in_features // scales.shape[-1], "bits": packed.shape[-1] * 32 // in_features}
    return out


def _dequantized(weights: dict, quant: dict) -> dict:
    out = dict(weights)
    for path, q in quant.items():
        w, s, b = out.pop(f"{path}.weight"), out.pop(f"{path}.scales"), out.pop(f"{path}.biases")
        out[f"{path}.weight"] = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32),
                                              group_size=q["group_size"], bits=q["bits"])
    return out


def _build(args: ModelArgs, weights: dict, quant: dict, options: LoadOptions) -> Model:
    dtype = compute_dtype()
    model = Model(args, dtype)
    if quant and options.wants_dequantize():
        weights, quant = _dequantized(weights, quant), {}
    if quant:
        nn.quantize(model, class_predicate=lambda path, module: quant.get(path, False))
    weights = {k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise UserError(f"the weights do not fit the MLX Llama graph ({str(exc)[:160]}); the model variant is "
                        "not supported by --backend mlx") from None
    mx.eval(model.parameters())
    return model


# -- Hugging Face / MLX folders ------------------------------------------------------------
def load_folder(folder: Path, options: LoadOptions = LoadOptions()) -> tuple[LoadedModel, dict]:
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") in ("gemma3", "gemma3_text") or "Gemma3ForCausalLM" in (cfg.get("architectures") or []):
        args = gemma3.args_from_config(cfg, folder)
        model = gemma3.build(args, gemma3.folder_weights(folder), compute_dtype())
        return LoadedModel(model, args.inv_freqs(), args.layer_windows), cfg
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
    n_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    args = ModelArgs(
        hidden_size=hidden, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads", n_heads)), head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_base=float(cfg.get("rope_theta", 10000.0)),
        traditional_rope=False, tie_embeddings="lm_head.weight" not in weights,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in weights)
    inv_freq = inv_frequencies(head_dim, args.rope_base, _rope_scaling_factors(cfg, head_dim, folder))
    return LoadedModel(_build(args, weights, _folder_quant(cfg, weights), options), inv_freq), cfg


def _folder_quant(cfg: dict, weights: dict) -> dict:
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if not q:
        return {}
    if "bits" not in q or "group_size" not in q:
        raise UserError(f"config.json quantization {sorted(q)} is not MLX's (bits + group_size); use an MLX "
                        "or unquantized safetensors folder")
    default = {"group_size": int(q["group_size"]), "bits": int(q["bits"])}
    out = {}
    for key in weights:
        if key.endswith(".scales"):
            path = key[: -len(".scales")]
            override = q.get(path)
            out[path] = dict(override) if isinstance(override, dict) else default
    return out


def _rope_scaling_factors(cfg: dict, head_dim: int, folder: Path):
    """Divisors of the RoPE frequencies for Llama-3.1 style scaling; None without scaling."""
    rs = cfg.get("rope_scaling")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind != "llama3":
        raise UserError(f"{folder.name} uses RoPE scaling {kind!r}, which --backend mlx does not implement; "
                        "use --backend llamacpp")
    factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old = float(rs["original_max_position_embeddings"])
    base = inv_frequencies(head_dim, float(cfg.get("rope_theta", 10000.0)))
    divisors = []
    for f in base.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return mx.array(divisors, dtype=mx.float32)
