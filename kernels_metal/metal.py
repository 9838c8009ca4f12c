"""Where Metal kernels can run. A kernel is built once at import, and only where Metal exists."""
from __future__ import annotations

import mlx.core as mx


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # an MLX build without the metal module
        return False


def build(name: str, inputs: list[str], outputs: list[str], source: str, header: str = ""):
    """The compiled-on-first-call kernel object, or None where Metal is missing."""
    if not metal_available():
        return None
    return mx.fast.metal_kernel(name=name, input_names=inputs, output_names=outputs, source=source,
                                header=header)
