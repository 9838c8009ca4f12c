"""The fused replacement of ``kvcache.quant_attention.attend_reference`` (the policy cache's
attention over full-precision and 4/8-bit quantized tokens), with the same signature.

The reference stays in kvcache/ (``reference`` below is that function, not a copy). The kernel
rotates the pre-RoPE keys in registers at their in-cache positions, from the rope's inverse
frequencies (``rope.inv_freq``, [D/2], "rotate half" pairing as in ``backends/torch/rope.py``);
queries are rotated with ``rope.rotate`` exactly as the reference does. Angles are computed in
fp32 (position × frequency), as Hugging Face transformers does; the reference reads float64-built
tables, so the two differ by about position × 1e-7 radians."""
from __future__ import annotations

from typing import Protocol

import torch

from localctx.kernels_cuda.launch import FullSegment, LaunchConfig, QuantSegment, Queries, run_attention
from localctx.kvcache.quant_attention import AttentionResult, FullTokens, QuantGroups, attend_reference

reference = attend_reference


class RotaryWithFrequencies(Protocol):
    inv_freq: torch.Tensor  # [D/2]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


# Everything below builds device tensors with kernels (arange/full), never from host lists, so a
# call can be captured in a CUDA graph.
def full_segment(full: FullTokens, dtype: torch.dtype) -> FullSegment:
    """One sequence's full-precision tokens as a FullSegment of one block (the whole sequence), in
    ``dtype``, for launch.run_attention."""
    k, v = full.k.to(dtype), full.v.to(dtype)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    Hkv, N, _ = k.shape
    dev = k.device
    return FullSegment(k=k, v=v, k_strides=(0, k.stride(1), k.stride(0)), v_strides=(0, v.stride(1), v.stride(0)),
                       block_table=torch.zeros((1, 1), dtype=torch.int32, device=dev), block_size=max(N, 1),
                       positions=full.positions.reshape(1, -1).contiguous(),
                       n_tokens=torch.full((1,), N, dtype=torch.int32, device=dev), max_tokens=N, n_kv_heads=Hkv)


def _quant_segment(quant: QuantGroups | None) -> QuantSegment | None:
    if quant is None or quant.n_groups == 0:
        return None
    G = quant.n_groups
    dev = quant.positions.device
    c = [t.contiguous() for t in (quant.k.codes, quant.k.scale, quant.k.min, quant.v.codes, quant.v.scale, quant.v.min)]
    return QuantSegment(*c, group_table=torch.arange(G, dtype=torch.int32, device=dev).reshape(1, G),
                        positions=quant.positions.reshape(1, G, -1).contiguous(),
                        n_groups=torch.full((1,), G, dtype=torch.int32, device=dev), bits=quant.k.bits,
                        group_size=quant.group_size)


def attend(q: torch.Tensor, q_positions: torch.Tensor, full: FullTokens, quant: QuantGroups | None,
           rope: RotaryWithFrequencies, *, scale: float | None = None, want_mass: bool = False,
           config: LaunchConfig = LaunchConfig()) -> AttentionResult:
    """Same contract as ``attend_reference`` (see kvcache/quant_attention.py); ``config`` only
    tunes the launch (split count, tile size). The kernel reads one precision for keys and values:
    a split policy's groups (k8v4, kf16v4) go to the reference."""
    if quant is not None and quant.n_groups and quant.uniform_bits is None:
        return attend_reference(q, q_positions, full, quant, rope, scale=scale, want_mass=want_mass)
    T, Hq, D = q.shape
    qr = rope.rotate(q.unsqueeze(0), q_positions.unsqueeze(0))
    seg_full = full_segment(full, q.dtype)
    seg_quant = _quant_segment(quant)
    out, mass = run_attention(Queries(qr, q_positions.reshape(1, T)), seg_full, seg_quant,
                              inv_freq=rope.inv_freq, scale=scale if scale is not None else D ** -0.5,
                              want_mass=want_mass, config=config)
    if mass is None:
        return AttentionResult(out[0])
    n_quant = 0 if seg_quant is None else quant.positions.numel()
    quant_mass = mass[0, :n_quant].reshape(quant.positions.shape) if n_quant else None
    return AttentionResult(out[0], mass[0, n_quant:], quant_mass)
