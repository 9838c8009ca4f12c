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
from localctx.backends.torch.linear import Linear, make_linear
from localctx.backends.torch.rope import Rope
from localctx.kvcache.errors import UserError
from localctx.kvcache.model_spec import ModelSpec


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear  # q, k and v projections fused into one matmul
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear  # gate and up projections fused
    down: Linear


class LlamaModel:
    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", weights: str = "dense", freq_factors: torch.Tensor | None = None):
        """``tensors``: GGUF-named float tensors in the HF layout ([out, in]); ``weights``: "dense"
        (stored in ``dtype``) or "int8" (weight-only int8, per output channel)."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.freq_factors = freq_factors

        def raw(name: str) -> torch.Tensor:
            t = tensors.get(name)
            if t is None:
                raise UserError(f"the model has no tensor {name!r}; the file is incomplete or not a "
                                f"{config.architecture} model")
            return t

        def take(name: str) -> torch.Tensor:
            return raw(name).to(device=device, dtype=dtype)

        def linear(*names: str, bias: bool = False) -> Linear:
            # weights keep the precision they were loaded in until make_linear converts them
            w = torch.cat([raw(f"{n}.weight").to(device) for n in names], dim=0)
            b = torch.cat([take(f"{n}.bias") for n in names], dim=0) if bias else None
            return make_linear(w, b, weights, dtype)

        self.embed = take("token_embd.weight")
        self.layers: list[Layer] = []
        for i in range(config.n_layers):
            p = f"blk.{i}."
            self.layers.append(Layer(
                attn_norm=take(p + "attn_norm.weight"),
                qkv=linear(p + "attn_q", p + "attn_k", p + "attn_v", bias=config.qkv_bias),
                q_norm=take(p + "attn_q_norm.weight") if config.qk_norm else None,
                k_norm=take(p + "attn_k_norm.weight") if config.qk_norm else None,
                wo=linear(p + "attn_output"),
                ffn_norm=take(p + "ffn_norm.weight"),
                gate_up=linear(p + "ffn_gate", p + "ffn_up"),
                down=linear(p + "ffn_down")))
        self.final_norm = take("output_norm.weight")
        head = tensors["output.weight"] if "output.weight" in tensors and not config.tie_embeddings else (
            raw("token_embd.weight"))
        self.lm_head = make_linear(head.to(device), None, weights, dtype)

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
        total = self.lm_head.nbytes() + self.final_norm.numel() * self.final_norm.element_size()
        for layer in self.layers:
            total += layer.qkv.nbytes() + layer.wo.nbytes() + layer.gate_up.nbytes() + layer.down.nbytes()
            total += (layer.attn_norm.numel() + layer.ffn_norm.numel()) * layer.attn_norm.element_size()
        return total

    # -- the forward ----------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.norm_eps)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache, *, all_logits: bool = False,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [B, T]. Returns float32 logits [B, vocab] for the last position of each row
        (or row b's position ``last[b]``, for rows padded after their tokens), or [B, T, vocab]
        with ``all_logits``."""
        c = self.config
        B, T = tokens.shape
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.attn_norm)
            qkv = layer.qkv(h)
            q, k, v = qkv.split((c.q_size, c.kv_size, c.kv_size), dim=-1)
            q = q.view(B, T, c.n_heads, c.head_dim)
            k = k.view(B, T, c.n_kv_heads, c.head_dim)
            v = v.view(B, T, c.n_kv_heads, c.head_dim)
            if layer.q_norm is not None:
                q = self._norm(q, layer.q_norm)
                k = self._norm(k, layer.k_norm)
            attn = cache.attend(i, q, k, v)
            x = x + layer.wo(attn.reshape(B, T, c.q_size))
            h = self._norm(x, layer.ffn_norm)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if not all_logits:
            x = x[:, -1] if last is None else x[torch.arange(B, device=x.device), last]
        return self.lm_head(self._norm(x, self.final_norm)).float()


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
