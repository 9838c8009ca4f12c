"""localctx's own Gemma 3 (text) model in torch, beside the Llama page (llama.py) and with the same
cache seam: ``out = cache.attend(layer_idx, q, k, v)`` with q/k/v before RoPE.

What differs from Llama:

- Five local layers to one global: layer ``i`` is global when ``(i + 1) % 6 == 0`` (llama.cpp's
  pattern for the ``gemma3`` GGUF architecture; a config.json may list ``layer_types``). A local
  layer attends over its last ``sliding_window`` tokens (query − key < window) and rotates with
  base 10000; a global layer attends over everything with the model's base (1e6) and scaling.
  The per-layer windows go to the KV cache (``layer_windows``), which keeps no more than that.
- RMSNorm of each head of q and k, queries scaled by ``query_pre_attn_scalar ** -0.5``.
- Embeddings scaled by sqrt(hidden); GeGLU MLP (GELU, tanh approximation); a norm before and
  after both attention and the MLP; tied embeddings; optional final logit soft-capping.
- Gemma's RMSNorm multiplies by (1 + weight). llama.cpp's converter stores 1 + weight in the GGUF,
  so the GGUF weights are used as they are and the HF loader adds the 1."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from localctx.backends.models.gguf_meta import ModelMeta
from localctx.backends.models.spec_reader import read_config_json
from localctx.backends.torch.config import BuildOptions, ModelShape
from localctx.backends.torch.gguf_loader import dequantize, spec_from
from localctx.backends.torch.layers import Attention, GatedMLP, RMSNorm, Weights, positions, tensor_bytes
from localctx.backends.torch.rope import Rope, RopeScaling
from localctx.kvcache.errors import UserError
from localctx.kvcache.model_spec import ModelSpec

GLOBAL_EVERY = 6  # llama.cpp src/llama-model.cpp, LLM_ARCH_GEMMA3: hparams.set_swa_pattern(6)
LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3 (config.json: rope_local_base_freq)
NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")


@dataclass(frozen=True)
class Gemma3Config(ModelShape):
    """architecture: gemma3"""
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None for a global layer
    query_scale: float  # query_pre_attn_scalar ** -0.5
    norm_eps: float = 1e-6
    rope_base: float = 1_000_000.0  # global layers
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # global layers only
    local_rope_base: float = LOCAL_ROPE_BASE
    final_softcap: float | None = None


def pattern_windows(n_layers: int, window: int | None) -> tuple[int | None, ...]:
    """llama.cpp's gemma3 layout: every sixth layer global, the others sliding over ``window``."""
    if not window:
        return (None,) * n_layers
    return tuple(None if (i + 1) % GLOBAL_EVERY == 0 else int(window) for i in range(n_layers))


def default_query_scale(n_layers: int, hidden: int, n_heads: int, head_dim: int) -> float:
    """What llama.cpp uses when the GGUF does not say: hidden / heads for the 62-layer 27B model,
    the head dim otherwise (query_pre_attn_scalar of the published configs)."""
    return (hidden / n_heads if n_layers == 62 else head_dim) ** -0.5


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@dataclass
class Layer:
    attn_norm: torch.Tensor
    attn: Attention  # with q/k norms
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    mlp: GatedMLP  # GeGLU
    post_ffn_norm: torch.Tensor

    def norms(self) -> tuple[torch.Tensor, ...]:
        return (self.attn_norm, self.attn.q_norm, self.attn.k_norm, self.post_attn_norm, self.ffn_norm,
                self.post_ffn_norm)


class Gemma3Model:
    def __init__(self, config: Gemma3Config, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", weights: str = "dense"):
        """``tensors``: GGUF-named float tensors ([out, in]) with the norms already 1 + weight."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.norm = RMSNorm(config.norm_eps, float32=True)
        w = Weights(tensors, dtype=dtype, device=device, weights=weights, model="Gemma 3 model")
        self.embed = w.take("token_embd.weight")
        self.layers = []
        for i in range(config.n_layers):
            p = f"blk.{i}."
            self.layers.append(Layer(
                attn_norm=w.take(p + "attn_norm.weight"), attn=Attention.load(w, p, config, bias=False, qk_norm=True),
                post_attn_norm=w.take(p + "post_attention_norm.weight"), ffn_norm=w.take(p + "ffn_norm.weight"),
                mlp=GatedMLP.load(w, p, gelu_tanh), post_ffn_norm=w.take(p + "post_ffw_norm.weight")))
        self.final_norm = w.take("output_norm.weight")
        self.lm_head = w.lm_head(tied=False)
        # the cache's attention scales by head_dim ** -0.5; the rest of the query scale goes here
        self.q_factor = config.query_scale * math.sqrt(config.head_dim)
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size), dtype=dtype).item()

    # -- what the engine asks ---------------------------------------------------------------
    def make_rope(self) -> list[Rope]:
        """One rope per layer: local layers rotate with the local base, global ones with the model's."""
        c = self.config
        local = Rope(c.head_dim, c.local_rope_base, dtype=torch.float32, device=self.device)
        full = Rope(c.head_dim, c.rope_base, c.rope_scaling, dtype=torch.float32, device=self.device)
        return [full if w is None else local for w in c.layer_windows]

    def layer_windows(self) -> tuple[int | None, ...]:
        return self.config.layer_windows

    def weight_bytes(self) -> int:
        """Bytes of the weights one decode step reads (the embedding table is only indexed)."""
        total = self.lm_head.nbytes() + tensor_bytes(self.final_norm)
        for layer in self.layers:
            total += layer.attn.nbytes() + layer.mlp.nbytes() + tensor_bytes(*layer.norms())
        return total

    # -- the forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache, *, all_logits: bool = False,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [B, T]. Returns float32 logits [B, vocab] (layers.positions: each row's last
        position, or ``last[b]``), or [B, T, vocab] with ``all_logits``."""
        x = self.embed[tokens] * self.embed_scale
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attn.heads(self.norm(x, layer.attn_norm), self.norm)
            x = x + self.norm(layer.attn.out(cache.attend(i, q * self.q_factor, k, v)), layer.post_attn_norm)
            x = x + self.norm(layer.mlp(self.norm(x, layer.ffn_norm)), layer.post_ffn_norm)
        logits = self.lm_head(self.norm(positions(x, all_logits, last), self.final_norm)).float()
        if self.config.final_softcap:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return logits


# -- loading ------------------------------------------------------------------------------------
def config_from_gguf(reader, path: Path) -> Gemma3Config:
    meta = ModelMeta(reader, path.name)
    n_layers, hidden = int(meta.need("block_count")), int(meta.need("embedding_length"))
    n_heads = int(meta.need("attention.head_count"))
    head_dim = int(meta.get("attention.key_length", hidden // n_heads))
    softcap = meta.get("final_logit_softcapping")
    return Gemma3Config(
        architecture=meta.arch, n_layers=n_layers, hidden_size=hidden, n_heads=n_heads,
        n_kv_heads=int(meta.get("attention.head_count_kv", n_heads)), head_dim=head_dim,
        intermediate_size=int(meta.need("feed_forward_length")), vocab_size=meta.vocab_size(),
        context_length=int(meta.need("context_length")),
        layer_windows=pattern_windows(n_layers, meta.get("attention.sliding_window")),
        query_scale=default_query_scale(n_layers, hidden, n_heads, head_dim),
        norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(meta.get("rope.freq_base", 1_000_000.0)), rope_scaling=RopeScaling.from_gguf(meta),
        final_softcap=float(softcap) if softcap else None)


def config_from_hf(cfg: dict, folder: Path) -> Gemma3Config:
    if "text_config" in cfg:
        raise UserError(f"{folder.name} is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); the torch "
                        "backend runs the text models (Gemma3ForCausalLM): use its GGUF or --backend llamacpp")
    n_layers, hidden, n_heads = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    else:
        every = int(cfg.get("sliding_window_pattern") or GLOBAL_EVERY)
        windows = tuple(None if (i + 1) % every == 0 or not window else int(window) for i in range(n_layers))
    if cfg.get("attn_logit_softcapping"):
        raise UserError(f"{folder.name} caps attention logits (attn_logit_softcapping), which the torch Gemma 3 "
                        "page does not run; use --backend llamacpp")
    scalar = cfg.get("query_pre_attn_scalar")
    softcap = cfg.get("final_logit_softcapping")
    return Gemma3Config(
        architecture="gemma3", n_layers=n_layers, hidden_size=hidden, n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 32768)), layer_windows=windows,
        query_scale=float(scalar) ** -0.5 if scalar else default_query_scale(n_layers, hidden, n_heads, head_dim),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_base=float(cfg.get("rope_theta", 1_000_000.0)),
        rope_scaling=RopeScaling.from_hf(cfg.get("rope_scaling")),
        local_rope_base=float(cfg.get("rope_local_base_freq", LOCAL_ROPE_BASE)),
        final_softcap=float(softcap) if softcap else None)


_HF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_HF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def hf_name(name: str) -> str | None:
    """HF tensor name → the GGUF name the model reads; None for tensors it does not use."""
    stem = name.removesuffix(".weight")
    if stem == name:
        return None
    if stem in _HF_TOP:
        return _HF_TOP[stem] + ".weight"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_LAYER:
        return f"blk.{parts[2]}.{_HF_LAYER[parts[3]]}.weight"
    return None


def is_norm(gguf_name: str) -> bool:
    return gguf_name == "output_norm.weight" or gguf_name.split(".")[-2] in NORMS


def from_gguf(reader, path: Path, name: str, build: BuildOptions) -> tuple[Gemma3Model, ModelSpec]:
    config = config_from_gguf(reader, path)
    weights = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {t.name: dequantize(weights, t).to(build.load_dtype) for t in reader.tensors}
    model = Gemma3Model(config, tensors, dtype=build.dtype, device=build.device, weights=build.weights)
    return model, spec_from(path, name)


def from_hf(folder: Path, name: str, build: BuildOptions) -> tuple[Gemma3Model, ModelSpec]:
    from safetensors import safe_open

    cfg = read_config_json(folder)
    config = config_from_hf(cfg, folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no .safetensors weights; give a folder with config.json and *.safetensors")
    tensors, stored, n_params = {}, 0, 0
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                ours = hf_name(key)
                if ours is None:
                    continue
                value = fh.get_tensor(key)
                stored += value.numel() * value.element_size()
                n_params += value.numel()
                value = value.float() + 1.0 if is_norm(ours) else value  # Gemma's norms scale by 1 + weight
                tensors[ours] = value.to(build.load_dtype)
    model = Gemma3Model(config, tensors, dtype=build.dtype, device=build.device, weights=build.weights)
    spec = ModelSpec(name=name, architecture="gemma3", n_layers=config.n_layers, n_heads=config.n_heads,
                     n_kv_heads=config.n_kv_heads, head_dim=config.head_dim, hidden_size=config.hidden_size,
                     vocab_size=config.vocab_size, context_length=config.context_length, rope_base=config.rope_base,
                     weight_bytes=stored, n_params=n_params, intermediate_size=config.intermediate_size)
    return model, spec
