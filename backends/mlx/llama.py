"""A Llama-family model graph in MLX (Llama, Mistral, Qwen2 biases, Qwen3 q/k norms). Attention
touches the KV cache in exactly one call: ``LayerCache.attend``, which owns RoPE too (keys
are cached before RoPE and rotated at their in-cache positions)."""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from localctx.backends.mlx.policy_cache import LayerCache, ModelCache


@dataclass(frozen=True)
class ModelArgs:
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    traditional_rope: bool = False  # True for GGUF: llama.cpp permutes Q/K into adjacent pairs
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.scale = a.head_dim ** -0.5
        self.q_proj = nn.Linear(a.hidden_size, a.n_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.n_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.n_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = nn.RMSNorm(a.head_dim, eps=a.rms_eps)
            self.k_norm = nn.RMSNorm(a.head_dim, eps=a.rms_eps)
        self.qk_norm = a.qk_norm

    def __call__(self, x: mx.array, cache: LayerCache) -> mx.array:
        length = x.shape[0]
        q = self.q_proj(x).reshape(length, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(length, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(length, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = cache.attend(q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1), self.scale)
        return self.o_proj(out.astype(x.dtype).swapaxes(0, 1).reshape(length, -1))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_eps)

    def __call__(self, x: mx.array, cache: LayerCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [Block(a) for _ in range(a.n_layers)]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_eps)


class Model(nn.Module):
    """Hugging Face parameter names (model.layers.N.self_attn.q_proj, ...), one sequence."""

    def __init__(self, a: ModelArgs, compute_dtype: mx.Dtype = mx.float32):
        super().__init__()
        self.args = a
        self.compute_dtype = compute_dtype
        self.model = LlamaBody(a)
        if not a.tie_embeddings:
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, cache: ModelCache, last_only: bool = True) -> mx.array:
        """tokens (L,) int → logits (V,) for the last token, or (L, V) with last_only=False."""
        h = self.model.embed_tokens(tokens).astype(self.compute_dtype)
        for block, layer_cache in zip(self.model.layers, cache.layers):
            h = block(h, layer_cache)
        if last_only:
            h = h[-1:]
        h = self.model.norm(h)
        logits = self.model.embed_tokens.as_linear(h) if self.args.tie_embeddings else self.lm_head(h)
        logits = logits.astype(mx.float32)
        return logits[0] if last_only else logits
