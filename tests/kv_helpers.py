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
