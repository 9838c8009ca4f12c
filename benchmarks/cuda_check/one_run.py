"""The CUDA path on one GPU, in one run of under 8 minutes (issue 24): compiled Triton kernels
against their references, decode attention against fp16 SDPA, and the torch backend end to end
beside the planner's projection. Results go to OUT/cuda-check.json and OUT/cuda-check.txt (plus
OUT/pytest-output.txt); the JSON is rewritten after every phase, so a run cut short keeps what it had.

    python benchmarks/cuda_check/one_run.py --out $OUT     # on the GPU machine
    python benchmarks/cuda_check/one_run.py --smoke --out /tmp/smoke       # tiny shapes, CPU, Triton's interpreter

Phases (each one's failure is recorded and the next still runs; ``--budget-s`` gives each phase a
deadline and records the cases it had no time for):

1. ``pytest -m cuda`` in a subprocess without TRITON_INTERPRET, then every kernel in kernels_cuda/
   against its pure reference over a shape grid (phase_kernels.py);
2. copy bandwidth: a device-to-device copy of 1 GiB, timed with CUDA events;
3. decode attention at 4K/32K/128K cached tokens, batch 1 and 8 (phase_decode.py);
4. the torch backend decoding a Llama-3.1-8B-shaped bf16 model with random weights at each context
   and KV policy, and the planner's projection for this GPU (phase_model.py).

Runs from a source checkout without installing: when ``localctx`` does not import from this
checkout, a temporary namespace folder of symlinks (localctx/app → app, ...) goes on sys.path.
It imports torch, triton and the standard library only (no gguf, tokenizers, llama_cpp, textual).
``--smoke`` sets TRITON_INTERPRET=1 and LOCALCTX_TRITON=interpret in this process before
anything imports Triton; the GPU mode never sets them and refuses to run when they are set."""
from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "backends", "kvcache", "kernels_cuda", "kernels_metal", "assets")
# phase → its deadline as a fraction of --budget-s (time a phase leaves unused rolls forward)
DEADLINES = {"pytest": 0.18, "kernels": 0.50, "bandwidth": 0.52, "decode_attention": 0.63, "end_to_end": 1.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "cuda-check-out"),
                   help="folder for the results (default: $OUT, else ./cuda-check-out)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through Triton's interpreter")
    p.add_argument("--budget-s", type=float, default=440.0,
                   help="seconds for the whole run; cases past a phase's share are skipped and recorded")
    p.add_argument("--skip", default="", help="comma-separated phases not to run: " + ", ".join(DEADLINES))
    p.add_argument("--wheels", type=Path, default=None,
                   help="folder of wheels to install offline first, e.g. benchmarks/cuda_check/wheels with "
                        "pytest's (docs/benchmarks-cuda.md)")
    return p.parse_args(argv)


def ensure_localctx() -> str | None:
    """Make ``import localctx`` load this checkout; returns the shim folder when one was needed."""
    def from_here() -> bool:
        try:
            module = importlib.import_module("localctx.kernels_cuda")
        except ImportError:
            return False
        return Path(module.__file__).resolve().parent == (ROOT / "kernels_cuda").resolve()

    if from_here():
        return None
    for name in [m for m in sys.modules if m == "localctx" or m.startswith("localctx.")]:
        del sys.modules[name]
    shim = Path(tempfile.mkdtemp(prefix="localctx-shim-"))
    atexit.register(shutil.rmtree, shim, True)
    (shim / "localctx").mkdir()
    for name in PACKAGES:
        (shim / "localctx" / name).symlink_to(ROOT / name, target_is_directory=True)
    sys.path.insert(0, str(shim))
    importlib.invalidate_caches()
    if not from_here():
        raise SystemExit(f"cuda_check: cannot import localctx from {ROOT} even through a shim at {shim}")
    return str(shim)


def install_wheels(folder: Path) -> dict:
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        return {"folder": str(folder), "installed": [], "note": "no wheels there"}
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(folder), *wheels],
                         capture_output=True, text=True, timeout=120)
    return {"folder": str(folder), "installed": [Path(w).name for w in wheels], "returncode": run.returncode,
            "output_tail": (run.stdout + run.stderr)[-1500:]}


def device_info(torch, device) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "machine": platform.machine(), "device": device.type}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"not importable: {exc}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, sm_count=props.multi_processor_count, memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}")
    else:
        info["name"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info


class Report:
    def __init__(self, out: Path, data: dict, start: float):
        self.out = out
        self.data = data
        self.start = start
        out.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str, fn) -> dict | None:
        t0 = time.monotonic()
        try:
            result = fn()
        except BaseException as exc:  # recorded; the next phase still runs
            if isinstance(exc, KeyboardInterrupt):
                raise
            result = {"status": "error", "error": f"{type(exc).__name__}: {str(exc)[:1000]}",
                      "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = time.monotonic() - t0
        self.data["phases"][name] = result
        self.write()
        print(f"[cuda_check] {name}: {result.get('status')} ({result['seconds']:.1f} s)", flush=True)
        return result

    def write(self) -> None:
        from summary import summary_text

        self.data["elapsed_s"] = time.monotonic() - self.start
        _atomic(self.out / "cuda-check.json", json.dumps(self.data, indent=1, default=str))
        _atomic(self.out / "cuda-check.txt", summary_text(self.data))


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def third_party_modules() -> list[str]:
    mine = {"localctx", "__main__"} | {m for m in sys.modules if m.startswith("cuda_check")}
    loaded = {m.split(".")[0] for m, module in sys.modules.items() if module is not None}  # None: blocked
    tops = loaded - set(sys.stdlib_module_names) - mine
    return sorted(t for t in tops if not t.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:  # before anything imports Triton
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["LOCALCTX_TRITON"] = "interpret"
    elif os.environ.get("TRITON_INTERPRET"):
        print("cuda_check: TRITON_INTERPRET is set; unset it to check compiled kernels (or pass --smoke)",
              file=sys.stderr)
        return 2
    elif os.environ.get("LOCALCTX_TRITON", "auto").strip().lower() not in ("", "auto"):
        print("cuda_check: LOCALCTX_TRITON is set; unset it so the kernels run compiled on the GPU", file=sys.stderr)
        return 2
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(DEADLINES):
        print(f"cuda_check: unknown phase(s) {', '.join(sorted(skip - set(DEADLINES)))}", file=sys.stderr)
        return 2
    wheels = install_wheels(args.wheels) if args.wheels else None
    shim = ensure_localctx()
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("cuda_check: torch sees no CUDA GPU; nothing was measured (use --smoke for the CPU proof)",
              file=sys.stderr)
        return 2
    import common

    device = torch.device("cuda" if not args.smoke else "cpu")
    sizes = common.smoke_sizes() if args.smoke else common.gpu_sizes()
    budget = common.Budget(args.budget_s)
    report = Report(args.out, {
        "script": "benchmarks/cuda_check/one_run.py", "argv": sys.argv[1:], "mode": "smoke" if args.smoke else "gpu",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget_s": args.budget_s, "shim": shim,
        "wheels": wheels, "device": device_info(torch, device), "phases": {}}, budget.start)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALCTX_TRITON")}
    if shim:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH")) if p)
    copy = {}

    def run(name: str, fn) -> None:
        if name in skip:
            report.data["phases"][name] = {"status": "skipped", "reason": "--skip"}
            return
        report.phase(name, fn)

    def tests() -> dict:
        import phase_kernels as ck

        return ck.run_pytest(budget.clock(DEADLINES["pytest"]), env, args.out)

    def kernels() -> dict:
        import phase_kernels as ck

        return ck.run_grid(sizes.kernels, budget.clock(DEADLINES["kernels"]), device)

    def bandwidth() -> dict:
        copy.update(common.copy_bandwidth(device, sizes.copy_bytes, sizes.copy_reps))
        return {"status": "ok", **copy}

    def decode() -> dict:
        import phase_decode as cd

        return cd.run(sizes.decode, budget.clock(DEADLINES["decode_attention"]), _copy_gbs(copy), device)

    def end_to_end() -> dict:
        import phase_model as cm

        return cm.run(sizes.model, budget.clock(DEADLINES["end_to_end"]), _copy_gbs(copy), device, args.smoke)

    run("pytest", tests)
    run("kernels", kernels)
    run("bandwidth", bandwidth)
    run("decode_attention", decode)
    run("end_to_end", end_to_end)
    report.data["imported_packages"] = third_party_modules()
    report.write()
    print((args.out / "cuda-check.txt").read_text())
    failed = [n for n, p in report.data["phases"].items() if p.get("status") not in ("ok", "skipped")]
    return 1 if failed else 0


def _copy_gbs(copy: dict) -> float:
    if "gbs" not in copy:
        raise RuntimeError("the copy bandwidth was not measured (the bandwidth phase failed or was skipped)")
    return copy["gbs"]


if __name__ == "__main__":
    sys.exit(main())
