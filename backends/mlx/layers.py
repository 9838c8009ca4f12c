"""The pieces the MLX model pages share (llama.py, gemma3.py; kept where they add what mlx-lm's
models lack, as each page says): the attention projections and the gated MLP, under Hugging Face's module names (self_attn.q_proj, mlp.gate_proj, ...), which the
weight loaders fill. Each page keeps its own block (where its norms and residuals go), body and
head."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from localctx.backends.mlx.policy_cache import LayerCache, ModelCache


@dataclass(frozen=True)
class ModelShape:
    """What every MLX model page's ModelArgs has (llama.py, gemma3.py)."""
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


@dataclass(frozen=True)
class AttentionArgs:
    """What a family sets in the shared attention."""
    scale: float  # of the scores (q·k times this)
    bias: bool = False  # on the q, k and v projections (Qwen2)
    qk_norm_eps: float | None = None  # RMSNorm each head of q and k with this eps (Qwen3, Gemma 3); None: none


class Attention(nn.Module):
    """Attention touches the KV cache in exactly one call, ``LayerCache.attend``, which owns RoPE
    too (keys are cached before RoPE and rotated at their in-cache positions)."""

    def __init__(self, shape: ModelShape, a: AttentionArgs):
        super().__init__()
        s = shape
        self.n_heads, self.n_kv_heads, self.head_dim = s.n_heads, s.n_kv_heads, s.head_dim
        self.scale = a.scale
        self.q_proj = nn.Linear(s.hidden_size, s.n_heads * s.head_dim, bias=a.bias)
        self.k_proj = nn.Linear(s.hidden_size, s.n_kv_heads * s.head_dim, bias=a.bias)
        self.v_proj = nn.Linear(s.hidden_size, s.n_kv_heads * s.head_dim, bias=a.bias)
        self.o_proj = nn.Linear(s.n_heads * s.head_dim, s.hidden_size, bias=False)
        self.qk_norm = a.qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(s.head_dim, eps=a.qk_norm_eps)
            self.k_norm = nn.RMSNorm(s.head_dim, eps=a.qk_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache) -> mx.array:
        length = x.shape[0]
        q = self.q_proj(x).reshape(length, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(length, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(length, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = cache.attend(q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1), self.scale)
        return self.o_proj(out.astype(x.dtype).swapaxes(0, 1).reshape(length, -1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with nn.silu, GeGLU with nn.gelu_approx."""

    def __init__(self, shape: ModelShape, activation: Callable[[mx.array], mx.array]):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)
        self.activation = activation

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class Body(nn.Module):
    """Hugging Face's ``model.``: the embedding table, the blocks and the final norm."""

    def __init__(self, shape: ModelShape, rms_eps: float, blocks: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = blocks
        self.norm = nn.RMSNorm(shape.hidden_size, eps=rms_eps)

    def __call__(self, h: mx.array, cache: ModelCache, last_only: bool) -> mx.array:
        """Embedded tokens (L, hidden) through every block, then the final norm: (L, hidden), or
        (1, hidden) for the last token with ``last_only``."""
        for block, layer_cache in zip(self.layers, cache.layers):
            h = block(h, layer_cache)
        return self.norm(h[-1:] if last_only else h)


class CausalLM(nn.Module):
    """What every page's Model is: ``args``, the compute dtype and ``model`` (the Body over the
    page's blocks), under Hugging Face's parameter names (model.layers.N.self_attn.q_proj, ...);
    the page adds its head and its ``__call__`` (one sequence: tokens (L,) → logits)."""

    def __init__(self, args: ModelShape, compute_dtype: mx.Dtype, rms_eps: float, blocks: list[nn.Module]):
        super().__init__()
        self.args = args
        self.compute_dtype = compute_dtype
        self.model = Body(args, rms_eps, blocks)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens).astype(self.compute_dtype)
