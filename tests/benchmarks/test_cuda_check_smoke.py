"""benchmarks/cuda_check/one_run.py --smoke, end to end on CPU: every phase of the GPU check runs its own
code paths with tiny shapes through Triton's interpreter, and its JSON says so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PHASES = {"pytest", "kernels", "bandwidth", "decode_attention", "end_to_end"}
# what the GPU machine does not have: the script must run without importing any of these
NOT_ON_THE_GPU_MACHINE = {"gguf", "llama_cpp", "textual", "tokenizers", "huggingface_hub", "jinja2", "psutil",
                          "rich", "platformdirs", "safetensors", "mlx"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'localctx[dev]')")
    out = tmp_path_factory.mktemp("cuda-check")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALCTX_TRITON", "OUT")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_check" / "one_run.py"), "--smoke", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads((out / "cuda-check.json").read_text())
    data["_text"] = (out / "cuda-check.txt").read_text()
    return data


@pytest.mark.slow
def test_every_phase_ran_with_results(smoke):
    assert smoke["mode"] == "smoke" and set(smoke["phases"]) == PHASES
    for name, phase in smoke["phases"].items():
        assert phase["status"] == "ok", (name, phase.get("error"), phase.get("errors"))
        assert not phase.get("skipped"), name  # the default budget leaves nothing out
    tests = smoke["phases"]["pytest"]
    assert tests["files"] and sum(tests["counts"].values()) >= 3  # the cuda tests were collected (and skip on CPU)
    assert tests["counts"]["failed"] == tests["counts"]["error"] == 0
    assert not set(smoke["imported_packages"]) & NOT_ON_THE_GPU_MACHINE
    for name in PHASES:
        assert f"== {name}: ok" in smoke["_text"]


@pytest.mark.slow
def test_kernel_grid_passes_and_covers_the_issue_cases(smoke):
    grid = smoke["phases"]["kernels"]
    assert grid["triton_interpret"] and grid["results"] and not grid["errors"]
    assert all(r["passed"] and r["max_abs_err"] <= r["tol"] for r in grid["results"])
    names = [(r["kernel"], r["case"]) for r in grid["results"]]
    kernels = {k for k, _ in names}
    assert kernels == {"quant_attention.attend", "paged_attention.paged_attention", "quant_append.quantize_append"}
    cases = " ".join(c for _, c in names)
    for part in ("d64-", "d128-", "gqa1-", "gqa4-", "int4-res", "int8-res", "-sink4-win", "-past64k", "-ropekeys"):
        assert part in cases, part
    assert any(k == "quant_attention.attend" and "past64k" in c for k, c in names)
    assert all(r["tol"] == 0 for r in grid["results"] if r["kernel"].startswith("quant_append"))


@pytest.mark.slow
def test_decode_attention_rows_and_bytes(smoke):
    dec = smoke["phases"]["decode_attention"]
    sizes = {(r["context"], r["batch"]) for r in dec["rows"]}
    assert sizes == {(96, 1), (96, 2), (160, 1), (160, 2)}
    for ctx, batch in sizes:
        rows = {r["variant"]: r for r in dec["rows"] if (r["context"], r["batch"]) == (ctx, batch)}
        assert {"sdpa", "fp16-triton-paged", "int8", "int4"} <= set(rows)
        assert rows["int4"]["bytes_read"] < rows["int8"]["bytes_read"] < rows["sdpa"]["bytes_read"]
        assert rows["sdpa"]["bytes_read"] == 2 * batch * ctx * 64 * 4  # K and V of one KV head, fp32
        assert all(r["eager_ms"] > 0 and r["speedup_vs_sdpa"] > 0 for r in rows.values())
    assert dec["checks"] and all(c["passed"] for c in dec["checks"])
    assert {c["variant"] for c in dec["checks"]} >= {"fp16-triton-paged", "int8", "int4"}


@pytest.mark.slow
def test_end_to_end_rows_follow_the_cost_model(smoke):
    e2e = smoke["phases"]["end_to_end"]
    assert e2e["kernels"] and e2e["dispatch_mode"] == "interpret"
    got = {(r["context"], r["policy"]) for r in e2e["rows"]}
    assert got == {(c, p) for c in (96, 160) for p in ("fp16", "int8", "int4+res16", "fp16+sink4+win32")}
    for r in e2e["rows"]:
        assert r["kv_bytes_cache"] == r["kv_bytes_cost_model"]  # the filled cache holds what kvcache/cost.py says
        assert r["bytes_per_step"] == e2e["weight_bytes"] + r["kv_bytes_cost_model"]
        assert r["tok_s"] > 0 and r["copy_fraction"] > 0
        planned = r["planner_measured"]
        assert planned["tok_s"] > 0 and abs(planned["measured_over_projected"] - r["tok_s"] / planned["tok_s"]) < 1e-9
    cache = {r["policy"]: r["cache"] for r in e2e["rows"]}
    assert cache["fp16"] == "PagedKVCache" and cache["int4+res16"] == "PolicyKVCache"
    by = {(r["context"], r["policy"]): r["kv_bytes_cost_model"] for r in e2e["rows"]}
    assert max(by[(160, "int4+res16")], by[(160, "int8")]) < by[(160, "fp16")]
    assert by[(160, "fp16+sink4+win32")] < by[(96, "fp16")]  # the window bounds what is held
