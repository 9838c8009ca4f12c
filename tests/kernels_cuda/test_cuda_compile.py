"""The CUDA kernels compile for the RTX 4090 (sm_89) and the H100 (sm_90) without a GPU, within their
limits: benchmarks/cuda_check/compile.py --subset ci (a representative few, among them a partial_kernel
and a mass_kernel specialization that used to spill; the whole set is docs/results/cuda/compile-sm89.json
and compile-sm90.json) must compile, spill nothing and fit the shared memory a block may use, launch
with the register cap of their warps, and agree with the launcher's committed resource table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localctx.kernels_cuda import launch, occupancy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    triton = pytest.importorskip("triton", reason="Triton is not installed (pip install 'localctx[dev]')")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton wheel ships no NVIDIA tools (ptxas, cuobjdump)")
    out = tmp_path_factory.mktemp("cuda-compile") / "ci.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALCTX_TRITON")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_check" / "compile.py"), "--subset", "ci",
                          "--arch", "sm_89,sm_90", "--jobs", "2", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text()) if out.exists() else {}
    data["_run"] = run
    return data


@pytest.mark.slow
def test_subset_compiles_without_spills_within_shared_memory(compiled):
    run = compiled["_run"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    kernels = {s["kernel"] for s in compiled["specializations"]}
    assert kernels == {"partial_kernel", "merge_kernel", "mass_kernel", "quant_keys_kernel", "quant_values_kernel"}
    for spec in compiled["specializations"]:
        for arch, r in spec["results"].items():
            limits = occupancy.ARCHS[arch]
            assert r["ok"] and not r["problems"], (spec["kernel"], arch, r["problems"])
            assert r["spill_stores"] == r["spill_loads"] == r["local"] == 0
            assert 0 < r["registers"] <= limits.max_regs_per_thread
            if spec["kernel"] in ("partial_kernel", "mass_kernel"):
                assert spec["options"]["maxnreg"] == occupancy.register_cap(limits, r["warps"])
            assert r["shared"] <= limits.smem_per_block
            assert r["blocks_per_sm"] == occupancy.occupancy(limits, r["registers"], r["shared"],
                                                             r["warps"]).blocks_per_sm >= 1


@pytest.mark.slow
def test_subset_matches_the_committed_table(compiled):
    """The launcher decides from kernels_cuda/resource_table.json: a kernel edit that changes the
    compiled resources without recompiling the table fails here (same Triton version only)."""
    table = json.loads(launch.TABLE.read_text())
    if table["triton"] != compiled["triton"]:
        pytest.skip(f"the table was compiled with Triton {table['triton']}, this is {compiled['triton']}")
    partials = [s for s in compiled["specializations"] if s["kernel"] == "partial_kernel"]
    assert partials
    for spec in partials:
        c = spec["constexprs"]
        key = launch.table_key(c["HEAD_DIM"], spec["dtype"],
                               launch.segment_name(c["BITS"] if c["HAS_QUANT"] else None, c["GROUP"], c["ROPE"]),
                               c["BLOCK_N"])
        for arch, r in spec["results"].items():
            row = table["archs"][arch][key]
            assert (row["registers"], row["shared"], row["warps"]) == (r["registers"], r["shared"], r["warps"]), key
