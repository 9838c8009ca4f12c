"""`localctx run` on llama.cpp imports only what answering needs: no Rich, Textual, huggingface_hub,
torch, or (once the model's header is cached) the gguf package."""
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from localctx.app.cli import main
code = main(sys.argv[1:])
heavy = [m for m in ("torch", "textual", "rich", "huggingface_hub", "gguf", "mlx", "triton") if m in sys.modules]
print("RESULT", code, heavy)
"""


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stdout + proc.stderr
    return line[0]


def test_run_on_the_fake_backend_imports_no_other_command():
    assert _run("run", "--backend", "fake", "--max-tokens", "2", "hi") == "RESULT 0 []"


@pytest.mark.slow
def test_run_on_llamacpp_imports_no_ui_hub_torch_or_gguf_once_the_header_is_cached(smollm2_path):
    first = _run("run", "-m", str(smollm2_path), "--max-tokens", "1", "hi")
    assert first.startswith("RESULT 0"), first  # the first run parses the header (gguf's type sizes)
    assert _run("run", "-m", str(smollm2_path), "--max-tokens", "1", "hi") == "RESULT 0 []"
