"""torch, mlx and triton are extras: the base install (llama.cpp on CPU) must never import them."""
import subprocess
import sys

SCRIPT = """
import sys
from localctx.app.cli import main
codes = [main(["run", "--backend", "fake", "--max-tokens", "3", "hi"]),
         main(["plan", "--hardware", "m2-max-64gb", "-m", "llama-3-8b"]),
         main(["plan", "--hardware", "rtx4090", "-m", "llama-3-8b", "--context", "32768"])]
heavy = [m for m in ("torch", "mlx", "triton") if m in sys.modules]
print("RESULT", codes, heavy)
"""


def test_run_and_plan_never_import_torch_mlx_or_triton():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stdout + proc.stderr
    assert line[0] == "RESULT [0, 0, 0] []", line[0]
