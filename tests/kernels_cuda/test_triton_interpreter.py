"""The Triton kernels' CPU tests run through Triton's interpreter, which TRITON_INTERPRET=1 turns on
for a whole process at import time. So they run here in a pytest process of their own: a suite on
a GPU machine (``pytest -m cuda``) compiles the kernels in-process instead of quietly interpreting
them, and the CPU CI still checks the kernels against their references."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
INTERPRETER_TESTS = ("test_cuda_kernels.py", "test_cuda_kernels_e2e.py", "test_cuda_kernels_model.py")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed (pip install 'localctx[dev]')")
def test_triton_kernels_through_the_interpreter_in_their_own_process(request):
    env = {k: v for k, v in os.environ.items() if k != "LOCALCTX_TRITON"}
    env["TRITON_INTERPRET"] = "1"
    marks = request.config.getoption("markexpr") or ""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(HERE.parents[1]),
           *(["-m", marks] if marks else []), *(str(HERE / name) for name in INTERPRETER_TESTS)]
    run = subprocess.run(cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode in (0, 5), run.stdout[-6000:] + run.stderr[-2000:]  # 5: every test deselected
    assert " passed" in run.stdout or run.returncode == 5, run.stdout[-2000:]


@pytest.mark.parametrize("name", INTERPRETER_TESTS)
def test_importing_an_interpreter_test_here_leaves_the_interpreter_off(name, monkeypatch):
    """What used to happen at collection: the module switched the interpreter on for the whole
    suite. Now it skips itself outside its own process and leaves the environment alone."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = importlib.util.spec_from_file_location(f"_probe_{name[:-3]}", HERE / name)
    with pytest.raises(pytest.skip.Exception, match="their own process"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert "TRITON_INTERPRET" not in os.environ
