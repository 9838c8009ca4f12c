"""Linear layers the model uses: dense (weights in the compute dtype) or weight-only int8
(one symmetric scale per output channel; the matmul dequantises on the fly, so decode reads
a quarter of fp32's bytes). Both compute ``x @ W.T + b``."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from localctx.kvcache.errors import UserError

WEIGHT_FORMATS = ("dense", "int8")


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
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(weight.dtype)
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.qweight, self.scales)
        out = out.reshape(*lead, self.out_features)
        return out + self.bias if self.bias is not None else out

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def nbytes(self) -> int:
        b = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size() + b


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> Linear:
    if fmt == "dense":
        return DenseLinear(weight, bias)
    if fmt == "int8":
        if weight.device.type != "cpu":
            raise UserError("weight-only int8 runs on CPU in the torch backend; use dense weights on CUDA")
        return Int8Linear(weight, bias)
    raise UserError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
