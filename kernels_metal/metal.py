"""Where Metal kernels can run. A kernel is built once at import, and only where Metal exists."""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

HEADER = """
#include <metal_stdlib>
using namespace metal;
"""


@dataclass(frozen=True)
class KernelSource:
    """A kernel's Metal body and its buffer names, as mx.fast.metal_kernel takes them (kept as
    data so a test can also compile the same text elsewhere)."""
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    source: str
    header: str = HEADER


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # an MLX build without the metal module
        return False


def build(kernel: KernelSource):
    """The compiled-on-first-call kernel object, or None where Metal is missing."""
    if not metal_available():
        return None
    return mx.fast.metal_kernel(name=kernel.name, input_names=list(kernel.inputs),
                                output_names=list(kernel.outputs), source=kernel.source, header=kernel.header)


@dataclass(frozen=True)
class Launch:
    """Everything one kernel call passes besides the kernel: inputs in order, template values,
    grid and threadgroup (in threads), and the outputs' shapes and dtypes."""
    inputs: list
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list

    def run(self, kernel) -> list:
        return kernel(inputs=self.inputs, template=self.template, grid=self.grid, threadgroup=self.threadgroup,
                      output_shapes=self.output_shapes, output_dtypes=self.output_dtypes)
