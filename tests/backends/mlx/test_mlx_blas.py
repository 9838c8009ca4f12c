"""MLX's matrix products go to a system OpenBLAS when localctx's MLX backend is imported before mlx.core
(backends/mlx/blas.py), and stay on MLX's bundled BLAS when asked or when it is too late. Each case is
a fresh process: a process can load only one BLAS for MLX."""
import ctypes.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
pytestmark = pytest.mark.skipif(sys.platform != "linux" or ctypes.util.find_library("openblas") is None,
                                reason="needs Linux with a system OpenBLAS (apt install libopenblas0)")

PRODUCT = """
import hashlib, json, sys
import numpy as np
{first}
from localctx.backends.mlx.blas import use_system_openblas
import mlx.core as mx
rng = np.random.default_rng(0)
a, b = rng.standard_normal((64, 4096), dtype=np.float32), rng.standard_normal((4096, 96), dtype=np.float32)
got = np.array(mx.array(a) @ mx.array(b))
want = a.astype(np.float64) @ b.astype(np.float64)
maps = open("/proc/self/maps").read()
torch_digest = None
if "torch" in sys.modules:
    import torch
    torch.set_num_threads(1)
    torch_digest = hashlib.sha256((torch.from_numpy(a) @ torch.from_numpy(b)).numpy().tobytes()).hexdigest()
print(json.dumps({{"library": use_system_openblas().library, "reason": use_system_openblas().reason,
                  "mapped": "libopenblas" in maps, "err": float(np.abs(got - want).max()),
                  "digest": hashlib.sha256(got.tobytes()).hexdigest(), "torch": torch_digest}}))
"""
TORCH_ALONE = """
import hashlib, numpy as np, torch
torch.set_num_threads(1)
rng = np.random.default_rng(0)
a, b = rng.standard_normal((64, 4096), dtype=np.float32), rng.standard_normal((4096, 96), dtype=np.float32)
print(hashlib.sha256((torch.from_numpy(a) @ torch.from_numpy(b)).numpy().tobytes()).hexdigest())
"""


def _product(first: str = "", **env) -> dict:
    run = subprocess.run([sys.executable, "-c", PRODUCT.format(first=first)], capture_output=True, text=True,
                         env={**{k: v for k, v in os.environ.items() if k != "LOCALCTX_MLX_BLAS"}, **env}, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_mlx_multiplies_with_the_system_openblas_unless_told_or_too_late():
    fast = _product()
    bundled = _product(LOCALCTX_MLX_BLAS="bundled")
    late = _product(first="import mlx.core")
    assert fast["library"] and fast["mapped"]
    assert bundled["library"] is None and "LOCALCTX_MLX_BLAS=bundled" in bundled["reason"] and not bundled["mapped"]
    assert late["library"] is None and "imported before" in late["reason"] and not late["mapped"]
    for r in (fast, bundled, late):  # the same product to float32 summation noise (|values| ~ 64 here)
        assert r["err"] < 1e-3
    # the reference BLAS sums each dot product in order; OpenBLAS in blocks: other bits, so MLX really
    # called the library it says it did
    assert bundled["digest"] == late["digest"] != fast["digest"]


def test_torch_imported_first_keeps_its_own_blas_beside_mlx_on_openblas():
    """What tests/conftest.py relies on: torch binds its BLAS calls as it loads, so the OpenBLAS loaded
    for MLX after it changes MLX's products and not torch's."""
    pytest.importorskip("torch", reason="the torch backend needs torch")
    both = _product(first="import torch")
    alone = subprocess.run([sys.executable, "-c", TORCH_ALONE], capture_output=True, text=True, timeout=120, check=True)
    assert both["library"] and both["digest"] == _product()["digest"]
    assert both["torch"] == alone.stdout.strip()
