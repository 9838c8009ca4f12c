"""On a machine with an NVIDIA GPU: the compiled kernels (not the interpreter) against their
references, through the benchmark's own check on short contexts (it exits 1 on a mismatch)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_compiled_kernels_match_their_references_on_the_gpu():
    pytest.importorskip("triton", reason="Triton is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALCTX_TRITON")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_check" / "attention_bench.py"),
                          "--contexts", "4096,8192", "--reps", "5"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "int4" in run.stdout and "fp16-sdpa" in run.stdout
