"""A Llama-family model graph in MLX (Llama, Mistral, Qwen2 biases, Qwen3 q/k norms): pre-norm
blocks of attention and a SwiGLU MLP (layers.py: attention touches the KV cache only through
``LayerCache.attend``).

mlx-lm runs these families too (zoo.py, the default); this page is kept for what mlx-lm's models
cannot take, and ``zoo.graph_for`` sends a model here for it: RoPE inside the cache (keys cached
before RoPE and rotated at their in-cache positions, so a sinks + window policy streams past the
trained context), heavy hitters (the attention mass its attention returns), the fused Metal decode
kernel, and GGUF Q4_0/Q4_1/Q8_0 tensors read as they are stored."""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from localctx.backends.mlx.layers import Attention, AttentionArgs, CausalLM, GatedMLP, ModelShape
from localctx.backends.mlx.policy_cache import LayerCache, ModelCache


@dataclass(frozen=True)
class ModelArgs(ModelShape):
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    traditional_rope: bool = False  # True for GGUF: llama.cpp permutes Q/K into adjacent pairs
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a, AttentionArgs(a.head_dim ** -0.5, bias=a.attention_bias,
                                                    qk_norm_eps=a.rms_eps if a.qk_norm else None))
        self.mlp = GatedMLP(a, nn.silu)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_eps)

    def __call__(self, x: mx.array, cache: LayerCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(CausalLM):
    def __init__(self, a: ModelArgs, compute_dtype: mx.Dtype = mx.float32):
        super().__init__(a, compute_dtype, a.rms_eps, [Block(a) for _ in range(a.n_layers)])
        if not a.tie_embeddings:
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, cache: ModelCache, last_only: bool = True) -> mx.array:
        """tokens (L,) int → logits (V,) for the last token, or (L, V) with last_only=False."""
        h = self.model(self.embed(tokens), cache, last_only)
        logits = self.model.embed_tokens.as_linear(h) if self.args.tie_embeddings else self.lm_head(h)
        logits = logits.astype(mx.float32)
        return logits[0] if last_only else logits
