"""Rotary position embeddings as the Llama family defines them: the model builds a ``Rope`` from
its config (base, scaling) and hands it to the KV cache, which rotates queries and keys at their
positions in the cache (kvcache.attention.Rotary).

Weights are in the Hugging Face layout (GGUF Q/K rows are un-permuted on load), so the rotation
pairs channel i with channel i + head_dim/2 ("rotate half")."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from localctx.backends.models.gguf_meta import ModelMeta
from localctx.kvcache.errors import UserError


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    @classmethod
    def from_hf(cls, cfg: dict | None) -> "RopeScaling":
        if not cfg:
            return cls()
        kind = cfg.get("rope_type") or cfg.get("type") or "default"
        if kind == "default":
            return cls()
        if kind == "linear":
            return cls("linear", float(cfg["factor"]))
        if kind == "llama3":
            return cls("llama3", float(cfg["factor"]), float(cfg.get("low_freq_factor", 1.0)),
                       float(cfg.get("high_freq_factor", 4.0)),
                       int(cfg.get("original_max_position_embeddings", 8192)))
        raise UserError(f"RoPE scaling {kind!r} is not supported by the torch backend (it runs none, linear "
                        "and llama3); use the llamacpp backend for this model")

    @classmethod
    def from_gguf(cls, meta: ModelMeta) -> "RopeScaling":
        """A GGUF's scaling: none or linear (llama3-style factors come as the rope_freqs tensor)."""
        factor = meta.linear_rope("the torch backend")
        return cls() if factor is None else cls("linear", factor)


def inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling = RopeScaling(),
                        freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """One frequency per channel pair, in float64 for exact tables."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if freq_factors is not None:  # GGUF rope_freqs: llama3-style factors precomputed by the converter
        return inv / freq_factors.to(torch.float64)
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "llama3":
        low_wavelen = scaling.original_context / scaling.low_freq_factor
        high_wavelen = scaling.original_context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (scaling.original_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class Rope:
    """cos/sin tables grown on demand; ``rotate`` follows kvcache.attention.Rotary."""

    def __init__(self, head_dim: int, base: float, scaling: RopeScaling = RopeScaling(),
                 freq_factors: torch.Tensor | None = None, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", initial: int = 4096):
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, base, scaling, freq_factors).to(device)
        self.dtype = dtype
        self.device = device
        self._last: tuple | None = None
        self._half: tuple[torch.Tensor, torch.Tensor] | None = None
        self._build(initial)

    def _build(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float64, device=self.device)
        angles = torch.outer(pos, self.inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(self.dtype)
        self.sin = angles.sin().to(self.dtype)
        self._last = None
        self._half = None

    def ensure(self, n_positions: int) -> None:
        if n_positions > self.cos.shape[0]:
            self._build(max(n_positions, 2 * self.cos.shape[0]))

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at ``positions`` ([B, T] → [B, T, 1, D/2]) in ``dtype``. Every layer of a forward
        rotates at the same positions, so the last lookup is kept and reused."""
        key = (positions, dtype)
        if self._last is not None and self._last[0] is positions and self._last[1] == dtype:
            return self._last[2]
        self.ensure(int(positions.max()) + 1)
        half = self.head_dim // 2
        cos = self.cos[positions][..., None, :half].to(dtype)
        sin = self.sin[positions][..., None, :half].to(dtype)
        self._last = (key[0], dtype, (cos, sin))
        return cos, sin

    def half_tables(self, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin [≥ n_positions, D/2], contiguous: the tables a C kernel reads."""
        self.ensure(n_positions)
        if self._half is None:
            half = self.head_dim // 2
            self._half = (self.cos[:, :half].float().contiguous(), self.sin[:, :half].float().contiguous())
        return self._half

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H, D]; positions: [B, T]."""
        cos, sin = self.tables(positions, x.dtype)
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
