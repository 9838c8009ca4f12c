"""Test helpers for the KV-cache tests: a plain RoPE (rotate-half, as Llama) built from scratch."""
from __future__ import annotations

import torch


class PlainRope:
    def __init__(self, head_dim: int, base: float = 10000.0):
        self.head_dim = head_dim
        self.inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ang = positions.to(torch.float64)[..., None] * self.inv  # [B, T, D/2]
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos().to(x.dtype).unsqueeze(2), ang.sin().to(x.dtype).unsqueeze(2)
        half = self.head_dim // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def random_steps(seed: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int):
    """``step(T)``: random q, k, v for T new tokens on every layer, from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return lambda T: [tuple(torch.randn(1, T, h, head_dim, generator=gen) for h in (n_heads, n_kv_heads, n_kv_heads))
                      for _ in range(n_layers)]


@torch.inference_mode()  # as the sessions run it (import_sequence makes inference tensors)
def attend_step(cache, qkv) -> list[torch.Tensor]:
    """One step of sequence 0 through ``cache``: every layer's attention output for ``qkv`` (random_steps)."""
    cache.begin_step([0], qkv[0][0].shape[1])
    out = [cache.attend(i, q, k, v) for i, (q, k, v) in enumerate(qkv)]
    cache.end_step()
    return out
