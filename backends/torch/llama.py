"""localctx's own Llama-family model in torch: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3
(q/k norm), SmolLM2. Grouped-query attention and RoPE happen in the KV cache through the seam

    out = cache.attend(layer_idx, q, k, v)     # q/k/v before RoPE

so that the cache decides where keys sit (paged blocks, in-cache positions). The engine calls
``cache.begin_step`` before each forward."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from localctx.backends.models.spec_reader import hf_spec
from localctx.backends.torch.config import BuildOptions, LlamaConfig
from localctx.backends.torch.gguf_loader import load_gguf, spec_from
from localctx.backends.torch.hf_loader import load_hf
from localctx.backends.torch.layers import Attention, GatedMLP, RMSNorm, Weights, positions, tensor_bytes
from localctx.backends.torch.rope import Rope
from localctx.kvcache.model_spec import ModelSpec


@dataclass
class Layer:
    attn_norm: torch.Tensor
    attn: Attention
    ffn_norm: torch.Tensor
    mlp: GatedMLP  # SwiGLU


class LlamaModel:
    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", weights: str = "dense", freq_factors: torch.Tensor | None = None):
        """``tensors``: GGUF-named float tensors in the HF layout ([out, in]); ``weights``: "dense"
        (stored in ``dtype``) or "int8" (weight-only int8, per output channel)."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.freq_factors = freq_factors
        self.norm = RMSNorm(config.norm_eps)
        w = Weights(tensors, dtype=dtype, device=device, weights=weights, model=f"{config.architecture} model")
        self.embed = w.take("token_embd.weight")
        self.layers: list[Layer] = []
        for i in range(config.n_layers):
            p = f"blk.{i}."
            self.layers.append(Layer(
                attn_norm=w.take(p + "attn_norm.weight"),
                attn=Attention.load(w, p, config, bias=config.qkv_bias, qk_norm=config.qk_norm),
                ffn_norm=w.take(p + "ffn_norm.weight"), mlp=GatedMLP.load(w, p, F.silu)))
        self.final_norm = w.take("output_norm.weight")
        self.lm_head = w.lm_head(tied=config.tie_embeddings)

    # -- what the engine asks ---------------------------------------------------------------
    def make_rope(self) -> Rope:
        c = self.config
        return Rope(c.head_dim, c.rope_base, c.rope_scaling, self.freq_factors, dtype=torch.float32,
                    device=self.device)

    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer attends over the whole context (no window of the model's own)."""
        return ()

    def weight_bytes(self) -> int:
        """Bytes of the weights one decode step reads (the embedding table is only indexed)."""
        total = self.lm_head.nbytes() + tensor_bytes(self.final_norm)
        for layer in self.layers:
            total += layer.attn.nbytes() + layer.mlp.nbytes() + tensor_bytes(layer.attn_norm, layer.ffn_norm)
        return total

    # -- the forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache, *, all_logits: bool = False,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [B, T]. Returns float32 logits [B, vocab] (layers.positions: each row's last
        position, or ``last[b]``), or [B, T, vocab] with ``all_logits``."""
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attn.heads(self.norm(x, layer.attn_norm), self.norm)
            x = x + layer.attn.out(cache.attend(i, q, k, v))
            x = x + layer.mlp(self.norm(x, layer.ffn_norm))
        x = positions(x, all_logits, last)
        return self.lm_head(self.norm(x, self.final_norm)).float()


# -- loading (backends/torch/loading.py picks this page by architecture) -------------------------
def from_gguf(reader, path: Path, name: str, build: BuildOptions) -> tuple[LlamaModel, ModelSpec]:
    config, tensors, freq_factors, reader = load_gguf(path, build.load_dtype, reader)
    model = LlamaModel(config, tensors, dtype=build.dtype, device=build.device, weights=build.weights,
                       freq_factors=freq_factors)
    return model, spec_from(path, name)


def from_hf(folder: Path, name: str, build: BuildOptions) -> tuple[LlamaModel, ModelSpec]:
    config, tensors = load_hf(folder, build.load_dtype)
    model = LlamaModel(config, tensors, dtype=build.dtype, device=build.device, weights=build.weights)
    return model, hf_spec(folder, name)
