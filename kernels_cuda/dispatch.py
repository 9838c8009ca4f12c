"""Which implementation runs: the Triton kernel on CUDA when Triton imports, the pure-torch
reference elsewhere.

``LOCALCTX_TRITON`` overrides the choice:

- ``interpret``: run the Triton kernels on CPU tensors through Triton's interpreter (sets
  ``TRITON_INTERPRET=1`` before the kernels are first imported; slow, for tests);
- ``off``: always the references, even on CUDA.

The kernels run for head dims 64, 128 and 256 only (``KERNEL_HEAD_DIMS``: the ones
``benchmarks/cuda_check/compile.py`` compiles for sm_89 and sm_90 and checks for spills and shared
memory); any other head dim takes the reference, and ``kernel_refusal`` says why. The functions
returned have exactly the reference's signature."""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

import torch

from localctx.kvcache import quant
from localctx.kvcache.paged_attention import paged_attention as paged_reference
from localctx.kvcache.quant_attention import attend_reference

ENV = "LOCALCTX_TRITON"
MODES = ("auto", "interpret", "off")


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_kernels(device: torch.device | str) -> bool:
    """True when calls on ``device`` tensors go to the Triton kernels."""
    chosen = mode()
    if chosen == "off" or not triton_importable():
        return False
    return torch.device(device).type == "cuda" or chosen == "interpret"


KERNEL_HEAD_DIMS = (64, 128, 256)


def kernel_refusal(head_dim: int) -> str | None:
    """Why the kernels do not take ``head_dim`` (None: they do)."""
    if head_dim in KERNEL_HEAD_DIMS:
        return None
    return (f"head dim {head_dim}: the CUDA kernels are compiled and checked for head dims "
            f"{', '.join(map(str, KERNEL_HEAD_DIMS))} only (docs/benchmarks-cuda.md); the pure-torch reference runs")


def kernel_supports(head_dim: int) -> bool:
    return kernel_refusal(head_dim) is None


def _kernels(name: str):
    if mode() == "interpret":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return importlib.import_module(f"localctx.kernels_cuda.{name}")


def policy_attention(device: torch.device | str) -> Callable:
    """The attention ``PolicyKVCache(attention=...)`` should use on ``device``."""
    if not uses_kernels(device):
        return attend_reference
    kernel = _kernels("quant_attention").attend

    def attend(q, q_positions, full, quant, rope, *, scale=None, want_mass=False):
        # the kernel reads one precision for keys and values: a split (k8v4, kf16v4) runs the reference
        one_precision = quant is None or quant.uniform_bits is not None
        run = kernel if kernel_supports(q.shape[-1]) and one_precision else attend_reference
        return run(q, q_positions, full, quant, rope, scale=scale, want_mass=want_mass)

    return attend


def paged_attention(device: torch.device | str) -> Callable:
    """The attention ``PagedKVCache(attention=...)`` should use on ``device``."""
    if not uses_kernels(device):
        return paged_reference
    kernel = _kernels("paged_attention").paged_attention

    def attend(q, k_blocks, v_blocks, block_tables, q_positions, *, key_rope=None, scale=None,
               contiguous_from=None, sinks=0, window=None):
        run = kernel if kernel_supports(q.shape[-1]) else paged_reference
        return run(q, k_blocks, v_blocks, block_tables, q_positions, key_rope=key_rope, scale=scale,
                   contiguous_from=contiguous_from, sinks=sinks, window=window)

    return attend


def quantize_groups(device: torch.device | str) -> Callable:
    """(k, v [G, H, g, D], bits, group_size) → (keys, values) QuantizedTensors stacked over G."""
    module = _kernels("quant_append") if uses_kernels(device) else None
    if module is None:
        return quantize_groups_reference

    def run(k, v, bits, group_size):
        if kernel_supports(k.shape[-1]):
            return module.quantize_groups(k, v, bits, group_size)
        return quantize_groups_reference(k, v, bits, group_size)

    return run


def quantize_groups_reference(k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int):
    """kvcache.quant's per-group functions, stacked: the reference of quant_append.quantize_groups."""
    keys = [quant.quantize_keys(k[i], bits) for i in range(k.shape[0])]
    values = [quant.quantize_values(v[i], bits, group_size) for i in range(v.shape[0])]
    stack = lambda qs: quant.QuantizedTensor(torch.stack([x.codes for x in qs]), torch.stack([x.scale for x in qs]),
                                             torch.stack([x.min for x in qs]), bits)
    return stack(keys), stack(values)
