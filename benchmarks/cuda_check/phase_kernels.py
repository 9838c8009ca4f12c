"""Phase 1 of benchmarks/cuda_check/one_run.py: ``pytest -m cuda`` in a subprocess (compiled kernels: the
child never gets TRITON_INTERPRET), then every kernel in kernels_cuda/ against its pure reference
over a shape grid — head dims, GQA ratios, 4/8-bit groups with a full-precision residual, sinks +
window masks, positions past 64K — with the max abs error, the tolerance and pass/fail per case."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common import KernelGrid, PhaseClock
from localctx.backends.torch.rope import Rope
from localctx.kernels_cuda.paged_attention import paged_attention, reference as paged_reference
from localctx.kernels_cuda.quant_append import QuantPool, quantize_append, quantize_append_reference
from localctx.kernels_cuda.quant_attention import attend, reference as attend_reference
from localctx.kvcache import quant
from localctx.kvcache.quant_attention import FullTokens, QuantGroups

ROOT = Path(__file__).resolve().parents[2]
FAR = 65_536  # "past 64K": some position of a far case is beyond this
# Absolute tolerances on outputs of unit-variance inputs. fp32: the CPU tests' 2e-4 plus their
# rtol 1e-3 on outputs below 1; with keys rotated from fp32 angles (the kernel) against float64
# tables (the reference) the angle error grows with the position (about position × 6e-8 rad), so
# far cases with rotated keys get 5e-3. bf16/fp16: the kernel rounds rotated keys and
# probabilities to the input dtype before its dots; the reference works in fp32 throughout.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
FAR_ROPE_FP32 = 5e-3


@dataclass
class CaseResult:
    kernel: str
    case: str
    dtype: str
    max_abs_err: float
    tol: float
    passed: bool
    seconds: float


# -- pytest -m cuda -----------------------------------------------------------------------------
def cuda_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text())


def run_pytest(clock: PhaseClock, env: dict, out_dir: Path) -> dict:
    """``pytest -m cuda`` over the test files that carry the marker; one JUnit record per test."""
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "reason": "pytest is not installed here (bring it as a wheel: --wheels DIR)"}
    files = cuda_test_files()
    timeout = max(10.0, min(clock.left(), 600.0))
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--junitxml={junit}", *files]
        t0 = time.monotonic()
        try:
            run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            code, output = run.returncode, run.stdout + run.stderr
        except subprocess.TimeoutExpired as exc:
            code, output = None, f"{exc.stdout or ''}{exc.stderr or ''}\n[cuda_check: killed after {timeout:.0f} s]"
        seconds = time.monotonic() - t0
        tests = parse_junit(junit) if junit.exists() else []
    (out_dir / "pytest-output.txt").write_text(output[-20000:] if isinstance(output, str) else str(output))
    outcome = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    status = "ok" if code == 0 else "failed"
    return {"status": status, "command": " ".join(cmd[1:]), "files": files, "returncode": code,
            "seconds": seconds, "counts": outcome, "tests": tests, "output_tail": output[-3000:],
            "env_without": ["TRITON_INTERPRET", "LOCALCTX_TRITON"]}


def parse_junit(path: Path) -> list[dict]:
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or node.text or "").strip().splitlines()[0][:300] if (
                    node.get("message") or node.text) else ""
                break
        out.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                    "seconds": float(case.get("time") or 0.0), "message": message})
    return out


# -- the shape grid ------------------------------------------------------------------------------
def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max())


def quant_groups(k: torch.Tensor, v: torch.Tensor, bits: int, g: int, positions: torch.Tensor) -> QuantGroups:
    """k, v: [Hkv, G*g, D] → the policy cache's layout, built with kvcache.quant (the reference)."""
    G = k.shape[1] // g
    kg = k.reshape(k.shape[0], G, g, -1).transpose(0, 1)
    vg = v.reshape(v.shape[0], G, g, -1).transpose(0, 1)
    return QuantGroups(quant.quantize_keys(kg, bits), quant.quantize_values(vg, bits, g), positions.reshape(G, g), g)


def policy_case(grid: KernelGrid, D: int, rep: int, bits: int, far: bool, dtype: torch.dtype,
                device: torch.device) -> tuple[float, float]:
    """The policy cache's attention: ``sinks`` full tokens, quantized groups, then the residual
    (the newest token is the query); keys before RoPE, rotated in the kernel. Returns (err, tol)."""
    g, S, Hkv = grid.group, grid.sinks, grid.kv_heads
    G = grid.near_groups if not far or grid.far_offset else -(-(FAR - S) // g)
    N = S + grid.residual
    offset = grid.far_offset if far else 0
    gen = torch.Generator(device=device).manual_seed(1000 * D + 10 * rep + bits + far)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)
    q_pos_all = torch.arange(G * g + N, device=device) + offset
    quant_pos = q_pos_all[S:S + G * g]
    full_pos = torch.cat([q_pos_all[:S], q_pos_all[S + G * g:]])
    groups = quant_groups(randn(Hkv, G * g, D) * 2, randn(Hkv, G * g, D), bits, g, quant_pos)
    k, v = (randn(Hkv, N, D) * 2).to(dtype), randn(Hkv, N, D).to(dtype)
    q = randn(1, Hkv * rep, D).to(dtype)
    q_pos = full_pos[-1:]
    rope = Rope(D, 500000.0 if D == 128 else 10000.0, device=str(device))
    want_mass = rep == 4  # heavy hitters: the mass kernel too
    ref = attend_reference(q.float(), q_pos, FullTokens(k.float(), v.float(), full_pos), groups, rope,
                           want_mass=want_mass)
    got = attend(q, q_pos, FullTokens(k, v, full_pos), groups, rope, want_mass=want_mass)
    err = _err(got.out, ref.out)
    if want_mass:
        err = max(err, _err(got.full_mass, ref.full_mass), _err(got.quant_mass, ref.quant_mass))
    tol = TOLERANCE[dtype] if not (far and dtype == torch.float32) else FAR_ROPE_FP32
    return err, tol


def paged_case(grid: KernelGrid, D: int, rep: int, masked: bool, far: bool, rope_keys: bool, dtype: torch.dtype,
               device: torch.device) -> tuple[float, float]:
    """The full-precision block pool: two sequences whose blocks are scattered over the pool, the
    longer one's newest token at ``far_keys - 1`` (far) or ``near_keys - 1``."""
    bs, Hkv = grid.block_size, grid.kv_heads
    L = grid.far_keys if far else grid.near_keys
    lengths = (L, max(1, L - 37))
    gen = torch.Generator(device=device).manual_seed(2000 * D + 10 * rep + 2 * masked + far)
    per_seq = [-(-n // bs) for n in lengths]
    n_blocks = sum(per_seq) + 1
    kb = (torch.randn(n_blocks, bs, Hkv, D, generator=gen, device=device) * 2).to(dtype)
    vb = torch.randn(n_blocks, bs, Hkv, D, generator=gen, device=device).to(dtype)
    perm = (torch.randperm(n_blocks - 1, generator=torch.Generator().manual_seed(D + rep)) + 1).to(device)
    tables = torch.zeros((2, max(per_seq)), dtype=torch.long, device=device)  # padding: block 0, masked out
    tables[0, :per_seq[0]] = perm[:per_seq[0]]  # the two sequences' blocks scattered over the pool
    tables[1, :per_seq[1]] = perm[per_seq[0]:]
    q = torch.randn(2, 1, Hkv * rep, D, generator=gen, device=device).to(dtype)
    q_pos = torch.tensor([[n - 1] for n in lengths], device=device)
    rope = Rope(D, 500000.0 if D == 128 else 10000.0, device=str(device), initial=L + 1) if rope_keys else None
    sinks, window = (grid.sinks, grid.window) if masked else (0, None)
    ref = paged_reference(q.float(), kb.float(), vb.float(), tables, q_pos, key_rope=rope, sinks=sinks, window=window)
    got = paged_attention(q, kb, vb, tables, q_pos, key_rope=rope, sinks=sinks, window=window)
    tol = FAR_ROPE_FP32 if (far and rope_keys and dtype == torch.float32) else TOLERANCE[dtype]
    return _err(got, ref), tol


def quantize_case(D: int, g: int, bits: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """Quantise-and-append into scattered pool slots, bit for bit against kvcache.quant: the error
    is the largest difference over codes (as integers), scales and mins; the tolerance is 0."""
    gen = torch.Generator(device=device).manual_seed(D + g + bits)
    G, H = 5, 2
    k = (torch.randn(G, H, g, D, generator=gen, device=device) * 3).to(dtype)
    v = torch.randn(G, H, g, D, generator=gen, device=device).to(dtype)
    k[0, 0, :, 5] = 1.25  # a constant channel: zero scale
    slots = torch.tensor([6, 0, 3, 2, 5], device=device)
    want, got = QuantPool.empty(7, H, D, bits, g, device), QuantPool.empty(7, H, D, bits, g, device)
    quantize_append_reference(k, v, bits, g, want, slots)
    quantize_append(k, v, bits, g, got, slots)
    err = max(_err(getattr(got, n).to(torch.int32) if n.endswith("codes") else getattr(got, n),
                   getattr(want, n).to(torch.int32) if n.endswith("codes") else getattr(want, n))
              for n in ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min"))
    return err, 0.0


def grid_cases(grid: KernelGrid) -> list[tuple[str, str, dict]]:
    """(kernel, case name, arguments) for every case. Ordered so that a short budget leaves out the
    least: quantise-and-append, then every "near" case, then the "far" ones, each in every dtype."""
    cases = []
    for dtype in grid.dtypes:
        for D in grid.head_dims:
            for g in grid.append_groups:
                for bits in grid.bits:
                    cases.append(("quant_append.quantize_append", f"d{D}-g{g}-int{bits}",
                                  dict(fn=quantize_case, D=D, g=g, bits=bits, dtype=dtype)))
    for far in (False, True):
        for dtype in grid.dtypes:
            cases += _attention_cases(grid, far, dtype)
    return cases


def _attention_cases(grid: KernelGrid, far: bool, dtype: torch.dtype) -> list[tuple[str, str, dict]]:
    cases = []
    for D in grid.head_dims:
        for rep in grid.gqa:
            for bits in grid.bits:
                name = f"d{D}-gqa{rep}-int{bits}-res{grid.residual}-sinks{grid.sinks}" + (
                    "-mass" if rep == 4 else "") + ("-past64k" if far else "")
                cases.append(("quant_attention.attend", name,
                              dict(fn=policy_case, grid=grid, D=D, rep=rep, bits=bits, far=far, dtype=dtype)))
    keys = grid.far_keys if far else grid.near_keys
    for D in grid.head_dims:
        for rep in grid.gqa:
            for masked in (False, True):
                for rope_keys in ((False, True) if far else (False,)):
                    name = (f"d{D}-gqa{rep}-bs{grid.block_size}-{keys}keys"
                            + (f"-sink{grid.sinks}-win{grid.window}" if masked else "")
                            + ("-ropekeys" if rope_keys else "") + ("-past64k" if keys > FAR else ""))
                    cases.append(("paged_attention.paged_attention", name,
                                  dict(fn=paged_case, grid=grid, D=D, rep=rep, masked=masked, far=far,
                                       rope_keys=rope_keys, dtype=dtype)))
    return cases


def run_grid(grid: KernelGrid, clock: PhaseClock, device: torch.device) -> dict:
    results, skipped, errors = [], [], []
    for kernel, name, args in grid_cases(grid):
        fn = args.pop("fn")
        dtype = args["dtype"]
        label = {"kernel": kernel, "case": name, "dtype": str(dtype).replace("torch.", "")}
        if not clock.allows(3.0):
            skipped.append({**label, "reason": "time budget"})
            continue
        t0 = time.monotonic()
        try:
            with torch.inference_mode():
                err, tol = fn(device=device, **args)
        except Exception as exc:  # a case that cannot run is a failure of that case, not of the phase
            errors.append({**label, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
            continue
        results.append(asdict(CaseResult(kernel, name, label["dtype"], err, tol, err <= tol, time.monotonic() - t0)))
    passed = sum(r["passed"] for r in results)
    status = "ok" if results and passed == len(results) and not errors else "failed"
    if not results and not errors and skipped:
        status = "skipped"  # no time was left for any case
    return {"status": status, "cases": len(results), "passed": passed, "results": results, "errors": errors,
            "skipped": skipped, "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
