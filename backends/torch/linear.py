"""Linear layers the model uses: dense (weights in the compute dtype) or int8 weights (one
symmetric scale per output channel, so decode reads a quarter of fp32's bytes). Both compute
``x @ W.T + b``. With int8 weights a single row (batch-1 decode) goes through the weight-only
kernel; several rows (batched decode, prefill) are quantized per row and multiplied in int8."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from localctx.kvcache.errors import UserError

WEIGHT_FORMATS = ("dense", "int8")
SINGLE_ROWS = 1  # up to this many rows, int8 weights use the weight-only kernel (activations unquantized)


class Linear(ABC):
    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes one matmul reads from the weights."""


class DenseLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.contiguous()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        b = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.weight.numel() * self.weight.element_size() + b


class Int8Linear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        """``weight`` in any float precision (quantized from float32); ``dtype``: activations'."""
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(dtype)
        self.scales_f32 = self.scales.float()  # the int8 × int8 path rescales in float32
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= SINGLE_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        else:
            out = self._int8_activations(rows)
        out = out.reshape(*lead, self.out_features)
        return out + self.bias if self.bias is not None else out

    def _int8_activations(self, rows: torch.Tensor) -> torch.Tensor:
        """Several rows at once (batched decode, prefill): each row is quantized to int8 with its
        own scale and multiplied in int8 × int8 → int32 (VNNI), as llama.cpp does with Q8
        activations; the weight-only kernel re-reads the weights for every row."""
        x = rows.to(torch.float32, copy=True)  # scaled in place below: never the caller's tensor
        row_scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(127.0)
        q = x.div_(row_scale).round_().to(torch.int8)
        acc = torch._int_mm(q, self.qweight.t())
        return acc.float().mul_(row_scale).mul_(self.scales_f32).to(rows.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def nbytes(self) -> int:
        b = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size() + b


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype) -> Linear:
    """``weight`` [out, in] in its loaded precision; ``dtype``: what the model computes in."""
    if fmt == "dense":
        return DenseLinear(weight.to(dtype), bias)
    if fmt == "int8":
        if weight.device.type != "cpu":
            raise UserError("weight-only int8 runs on CPU in the torch backend; use dense weights on CUDA")
        return Int8Linear(weight, bias, dtype)
    raise UserError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
