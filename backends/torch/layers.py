"""The pieces the torch model pages share (llama.py, gemma3.py): GGUF-named tensors read into the
compute dtype and into dense or int8 linears, RMSNorm, the attention projections (q, k and v in
one matmul, per-head q/k RMSNorm where the model has it, the output projection) and the gated
MLP. What is a family's own (the order of norms and residuals in its block, embedding scale,
logit capping, RoPE per layer) stays on its page."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localctx.backends.torch.config import ModelShape
from localctx.backends.torch.linear import Linear, make_linear
from localctx.kvcache.errors import UserError


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Weights:
    """GGUF-named float tensors ([out, in]) as the model computes with them: plain tensors in
    ``dtype`` on ``device``, linears ``weights`` = "dense" (in ``dtype``) or "int8" (weight-only,
    per output channel). ``model`` names the model in the error for a missing tensor."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype, device: str, weights: str,
                 model: str):
        self.tensors, self.dtype, self.device, self.weights, self.model = tensors, dtype, device, weights, model

    def raw(self, name: str) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise UserError(f"the model has no tensor {name!r}; the file is incomplete or not a {self.model}")
        return t

    def take(self, name: str) -> torch.Tensor:
        return self.raw(name).to(device=self.device, dtype=self.dtype)

    def linear(self, *names: str, bias: bool = False) -> Linear:
        """The named projections fused along their outputs (weights keep the precision they were
        loaded in until make_linear converts them)."""
        w = torch.cat([self.raw(f"{n}.weight").to(self.device) for n in names], dim=0)
        b = torch.cat([self.take(f"{n}.bias") for n in names], dim=0) if bias else None
        return make_linear(w, b, self.weights, self.dtype)

    def lm_head(self, tied: bool) -> Linear:
        """``output.weight``, or the embedding table where the model ties them or has no output."""
        name = "output.weight" if not tied and "output.weight" in self.tensors else "token_embd.weight"
        return make_linear(self.raw(name).to(self.device), None, self.weights, self.dtype)


@dataclass(frozen=True)
class RMSNorm:
    """RMSNorm over the last dim; ``float32``: computed in float32 and cast back (Gemma), else in
    the activations' dtype (Llama)."""
    eps: float
    float32: bool = False

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.float32:
            return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


@dataclass
class Attention:
    """The attention projections of one layer; RoPE and the attention itself happen in the KV cache."""
    shape: ModelShape
    qkv: Linear  # q, k and v projections fused into one matmul
    wo: Linear
    q_norm: torch.Tensor | None = None  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None

    @classmethod
    def load(cls, w: Weights, prefix: str, shape: ModelShape, *, bias: bool, qk_norm: bool) -> "Attention":
        return cls(shape, qkv=w.linear(prefix + "attn_q", prefix + "attn_k", prefix + "attn_v", bias=bias),
                   wo=w.linear(prefix + "attn_output"),
                   q_norm=w.take(prefix + "attn_q_norm.weight") if qk_norm else None,
                   k_norm=w.take(prefix + "attn_k_norm.weight") if qk_norm else None)

    def heads(self, h: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [B, T, hidden] → q [B, T, heads, head_dim], k and v [B, T, kv heads, head_dim]."""
        s = self.shape
        B, T = h.shape[:2]
        q, k, v = self.qkv(h).split((s.q_size, s.kv_size, s.kv_size), dim=-1)
        q = q.view(B, T, s.n_heads, s.head_dim)
        k = k.view(B, T, s.n_kv_heads, s.head_dim)
        v = v.view(B, T, s.n_kv_heads, s.head_dim)
        if self.q_norm is not None:
            q, k = norm(q, self.q_norm), norm(k, self.k_norm)
        return q, k, v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """The cache's output [B, T, heads, head_dim] → [B, T, hidden]."""
        B, T = attn.shape[:2]
        return self.wo(attn.reshape(B, T, self.shape.q_size))

    def nbytes(self) -> int:
        """Bytes of the projections (a page counts the norms it reads)."""
        return self.qkv.nbytes() + self.wo.nbytes()


@dataclass
class GatedMLP:
    """down(act(gate(x)) * up(x)), gate and up fused into one matmul: SwiGLU (SiLU), GeGLU (GELU)."""
    gate_up: Linear
    down: Linear
    activation: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def load(cls, w: Weights, prefix: str, activation: Callable[[torch.Tensor], torch.Tensor]) -> "GatedMLP":
        return cls(w.linear(prefix + "ffn_gate", prefix + "ffn_up"), w.linear(prefix + "ffn_down"), activation)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.activation(gate) * up)

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()


def positions(x: torch.Tensor, all_logits: bool, last: torch.Tensor | None) -> torch.Tensor:
    """The hidden states the logits are for: every position with ``all_logits``, else each row's
    last (or row b's position ``last[b]``, for rows padded after their tokens)."""
    if all_logits:
        return x
    return x[:, -1] if last is None else x[torch.arange(x.shape[0], device=x.device), last]
