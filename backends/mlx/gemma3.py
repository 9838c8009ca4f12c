"""Gemma 3 (text) in MLX, beside the Llama page (llama.py) and with the same cache seam:
attention touches the KV cache only through ``LayerCache.attend`` (keys cached before RoPE).

What differs from Llama (backends/torch/gemma3.py states the same for torch): five local layers
sliding over their own window, rotated with base 10000, to one global layer with the model's
base (llama.cpp's pattern: layer i is global when (i + 1) % 6 == 0); RMSNorm on each head of q
and k; queries scaled by query_pre_attn_scalar ** -0.5; embeddings scaled by sqrt(hidden); a
GeGLU MLP (tanh GELU); norms before and after attention and the MLP; tied embeddings. Norm
weights are used as (1 + weight): GGUFs store them so, the folder loader adds the 1.

mlx-lm's gemma3_text runs Gemma 3 at full precision on its own caches (zoo.py); this page is kept
because those caches take no localctx policy: here the sliding layers run ``layer_policy`` and every
8/4-bit, window and heavy-hitter policy runs (``zoo.graph_for`` picks the page for them)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from localctx.backends.models.gguf_header import dequantize_f32
from localctx.backends.models.gguf_meta import ModelMeta
from localctx.backends.mlx.layers import Attention, AttentionArgs, CausalLM, GatedMLP, ModelShape
from localctx.backends.mlx.policy_cache import LayerCache, ModelCache
from localctx.kernels_metal.rope import inv_frequencies
from localctx.kvcache.errors import UserError

GLOBAL_EVERY = 6  # llama.cpp src/llama-model.cpp, LLM_ARCH_GEMMA3: hparams.set_swa_pattern(6)
LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa (config.json: rope_local_base_freq)


@dataclass(frozen=True)
class ModelArgs(ModelShape):
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None for a global layer
    query_scale: float
    rms_eps: float = 1e-6
    rope_base: float = 1_000_000.0  # global layers
    rope_linear_factor: float = 1.0  # global layers' linear RoPE scaling
    local_rope_base: float = LOCAL_ROPE_BASE
    final_softcap: float | None = None
    traditional_rope: bool = False  # Gemma rotates halves in GGUF and HF alike

    def inv_freqs(self) -> list[mx.array]:
        """One table of RoPE frequencies per layer."""
        local = inv_frequencies(self.head_dim, self.local_rope_base)
        full = inv_frequencies(self.head_dim, self.rope_base) / self.rope_linear_factor
        return [full if w is None else local for w in self.layer_windows]


def pattern_windows(n_layers: int, window: int | None) -> tuple[int | None, ...]:
    if not window:
        return (None,) * n_layers
    return tuple(None if (i + 1) % GLOBAL_EVERY == 0 else int(window) for i in range(n_layers))


def default_query_scale(n_layers: int, hidden: int, n_heads: int, head_dim: int) -> float:
    """llama.cpp's choice when a GGUF does not say: hidden / heads for the 62-layer 27B, else head dim."""
    return (hidden / n_heads if n_layers == 62 else head_dim) ** -0.5


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a, AttentionArgs(a.query_scale, qk_norm_eps=a.rms_eps))
        self.mlp = GatedMLP(a, nn.gelu_approx)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_eps)
        self.post_feedforward_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_eps)

    def __call__(self, x: mx.array, cache: LayerCache) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Model(CausalLM):
    def __init__(self, a: ModelArgs, compute_dtype: mx.Dtype = mx.float32):
        super().__init__(a, compute_dtype, a.rms_eps, [Block(a) for _ in range(a.n_layers)])

    def __call__(self, tokens: mx.array, cache: ModelCache, last_only: bool = True) -> mx.array:
        """tokens (L,) int → logits (V,) for the last token, or (L, V) with last_only=False."""
        h = self.embed(tokens) * mx.array(math.sqrt(self.args.hidden_size), dtype=self.compute_dtype)
        logits = self.model.embed_tokens.as_linear(self.model(h, cache, last_only)).astype(mx.float32)
        if self.args.final_softcap:
            logits = mx.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits[0] if last_only else logits


# -- loading ------------------------------------------------------------------------------------
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


def _gguf_name(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.weight"
    if len(parts) == 2 and parts[0] in _GGUF_TOP and parts[1] == "weight":
        return f"{_GGUF_TOP[parts[0]]}.weight"
    raise UserError(f"the GGUF has a tensor {name!r} that the MLX Gemma 3 graph does not know")


def args_from_gguf(reader, name: str) -> ModelArgs:
    meta = ModelMeta(reader, name)
    n_layers, hidden = int(meta.need("block_count")), int(meta.need("embedding_length"))
    n_heads = int(meta.need("attention.head_count"))
    head_dim = int(meta.get("attention.key_length", hidden // n_heads))
    linear_rope = meta.linear_rope("--backend mlx")
    softcap = meta.get("final_logit_softcapping")
    return ModelArgs(
        hidden_size=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(meta.get("attention.head_count_kv", n_heads)),
        head_dim=head_dim, intermediate_size=int(meta.need("feed_forward_length")), vocab_size=meta.vocab_size(),
        layer_windows=pattern_windows(n_layers, meta.get("attention.sliding_window")),
        query_scale=default_query_scale(n_layers, hidden, n_heads, head_dim),
        rms_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(meta.get("rope.freq_base", 1e6)),
        rope_linear_factor=1.0 if linear_rope is None else linear_rope,
        final_softcap=float(softcap) if softcap else None)


def args_from_config(cfg: dict, folder: Path) -> ModelArgs:
    if "text_config" in cfg:
        raise UserError(f"{folder.name} is the multimodal Gemma 3; --backend mlx runs the text models "
                        "(Gemma3ForCausalLM): use its GGUF or --backend llamacpp")
    n_layers, hidden, n_heads = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    window, types = cfg.get("sliding_window"), cfg.get("layer_types")
    if types:
        windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    else:
        every = int(cfg.get("sliding_window_pattern") or GLOBAL_EVERY)
        windows = tuple(None if (i + 1) % every == 0 or not window else int(window) for i in range(n_layers))
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind not in ("default", "linear") or cfg.get("attn_logit_softcapping"):
        raise UserError(f"{folder.name}: RoPE scaling {kind!r} or attention soft-capping is not run by --backend mlx; "
                        "use --backend llamacpp")
    scalar, softcap = cfg.get("query_pre_attn_scalar"), cfg.get("final_logit_softcapping")
    return ModelArgs(
        hidden_size=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]), layer_windows=windows,
        query_scale=float(scalar) ** -0.5 if scalar else default_query_scale(n_layers, hidden, n_heads, head_dim),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_base=float(cfg.get("rope_theta", 1e6)),
        rope_linear_factor=float(rs.get("factor", 1.0)) if kind == "linear" else 1.0,
        local_rope_base=float(cfg.get("rope_local_base_freq", LOCAL_ROPE_BASE)),
        final_softcap=float(softcap) if softcap else None)


def gguf_weights(path: Path, reader) -> dict[str, mx.array]:
    """Every tensor dequantised with the gguf package (mx.load keeps only Q4_0/Q4_1/Q8_0 packed,
    and Gemma's GGUFs mix K-quants in), by HF name."""
    weights = np.memmap(path, dtype=np.uint8, mode="r")
    return {_gguf_name(t.name): mx.array(dequantize_f32(weights, t)) for t in reader.tensors}


def folder_weights(folder: Path) -> dict[str, mx.array]:
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    weights = {k: v for k, v in weights.items() if not k.startswith("lm_head")}  # tied to the embeddings
    return {k: (v.astype(mx.float32) + 1.0 if k.endswith("norm.weight") else v) for k, v in weights.items()}


def build(args: ModelArgs, weights: dict[str, mx.array], dtype: mx.Dtype) -> Model:
    model = Model(args, dtype)
    try:
        model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    except ValueError as exc:
        raise UserError(f"the weights do not fit the MLX Gemma 3 graph ({str(exc)[:160]})") from None
    mx.eval(model.parameters())
    return model
