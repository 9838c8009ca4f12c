"""Which BLAS MLX's CPU code calls on Linux.

MLX's Linux CPU wheel (mlx-cpu) bundles the netlib reference BLAS. On this project's 2-core AVX2 host its
float32 matmul runs at 1.9 GFLOP/s and OpenBLAS's at 136; the bundled SmolLM2 prefills at 5 tok/s on the
first and 166 on the second (docs/benchmarks-mlx.md, "Which BLAS MLX calls on Linux"). Loading a system
OpenBLAS with RTLD_GLOBAL before ``mlx.core`` is first imported makes MLX's ``cblas_*`` and LAPACK calls
resolve to it: the dynamic linker looks a library's symbols up in the global scope before that library's
own dependencies.

It is done once, by ``localctx.backends.mlx``'s ``__init__`` (every MLX path in localctx imports it before
``mlx.core``). Nothing changes on macOS (MLX uses Accelerate there), where no LP64 OpenBLAS is
installed (Debian/Ubuntu: ``apt install libopenblas0``), where ``mlx.core`` was imported first, or with
``LOCALCTX_MLX_BLAS=bundled``. The results differ from the reference BLAS's only in float32 summation
order. The OpenBLAS stays in the process's global scope: a library loaded after it that calls BLAS
through the dynamic linker binds to it too (torch's MKL ``sgemm_`` does), while one loaded before keeps
its own; localctx loads one engine per process (backends/registry.py), and the test suite imports torch
first (tests/conftest.py)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass

ENV = "LOCALCTX_MLX_BLAS"


@dataclass(frozen=True)
class BlasChoice:
    library: str | None  # the OpenBLAS MLX calls, or None: the BLAS bundled with MLX (or Accelerate)
    reason: str  # why


_choice: BlasChoice | None = None


def use_system_openblas() -> BlasChoice:
    """Load a system OpenBLAS for MLX if this process can still have it (idempotent)."""
    global _choice
    if _choice is not None:
        return _choice
    if sys.platform != "linux":
        _choice = BlasChoice(None, "not Linux: MLX's own BLAS")
    elif os.environ.get(ENV, "") == "bundled":
        _choice = BlasChoice(None, f"{ENV}=bundled")
    elif "mlx.core" in sys.modules:
        _choice = BlasChoice(None, "mlx.core was imported before localctx's MLX backend")
    else:
        name = ctypes.util.find_library("openblas")  # LP64 only: the ILP64 build is named openblas64
        if name is None:
            _choice = BlasChoice(None, "no system OpenBLAS (apt install libopenblas0)")
        else:
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                _choice = BlasChoice(name, "system OpenBLAS, loaded before mlx.core")
            except OSError as e:
                _choice = BlasChoice(None, f"{name} did not load: {e}")
    return _choice
