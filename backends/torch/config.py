"""The shape every torch model page's config shares, the Llama-family config (filled by the GGUF and
HF loaders), and the build options every model page takes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from localctx.backends.torch.rope import RopeScaling

# tensor names inside the torch backend (the GGUF names; the HF loader maps onto them)
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")


@dataclass(frozen=True)
class ModelShape:
    """What every model page's config has (llama.py's LlamaConfig, gemma3.py's Gemma3Config)."""
    architecture: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_length: int

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class LlamaConfig(ModelShape):
    """architecture: llama | mistral | qwen2 | qwen3"""
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    tie_embeddings: bool = False


@dataclass(frozen=True)
class BuildOptions:
    """How a model page builds its model: weights read in ``load_dtype``, computed in ``dtype`` on
    ``device``, linear weights ``dense`` or ``int8``."""
    load_dtype: torch.dtype
    dtype: torch.dtype
    device: str
    weights: str
