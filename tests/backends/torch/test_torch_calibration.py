"""The torch backend's calibration: timed per KV format on a tiny random-weight model, stored under
the settings it was measured with, and used by the planner only when the backend runs with them."""
from __future__ import annotations

import pytest
import torch

from localctx.backends.models.ref import ModelRef
from localctx.backends.machine.planner_inputs import planning_context
from localctx.backends.torch.backend import TorchBackend
from localctx.backends.torch.calibrate import POLICIES, calibrate
from localctx.kvcache import calibration, cost
from localctx.kvcache.calibration import Calibration, FormatCost
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

SMOL = known_spec("smollm2-135m")


@pytest.fixture(scope="module")
def tiny_ref(tmp_path_factory) -> ModelRef:
    cfg = TinyConfig(hidden=64, n_heads=2, n_kv_heads=1, head_dim=32)  # quantized KV groups 32 channels
    path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", cfg, tiny_weights(cfg, seed=5))
    return ModelRef("gguf", path, "tiny", "file")


def _cpu_env(monkeypatch, dtype: str, weights: str, threads: int) -> None:
    monkeypatch.setenv("LOCALCTX_TORCH_DEVICE", "cpu")
    monkeypatch.setenv("LOCALCTX_TORCH_DTYPE", dtype)
    monkeypatch.setenv("LOCALCTX_TORCH_WEIGHTS", weights)
    monkeypatch.setenv("LOCALCTX_TORCH_THREADS", str(threads))


def test_calibration_name_carries_every_setting_that_changes_speed(monkeypatch):
    _cpu_env(monkeypatch, "bf16", "int8", 2)
    assert TorchBackend().calibration_name() == "torch-cpu-bfloat16-int8-2t"
    _cpu_env(monkeypatch, "fp32", "dense", 1)
    assert TorchBackend().calibration_name() == "torch-cpu-float32-dense-1t"


def test_calibrate_times_each_format_at_each_context_with_the_cost_models_bytes(tiny_ref, monkeypatch):
    monkeypatch.setenv("LOCALCTX_TORCH_DEVICE", "cpu")
    monkeypatch.setenv("LOCALCTX_TORCH_DTYPE", "fp32")
    lines = []
    cal = calibrate(model=tiny_ref, contexts=(16, 64), rounds=2, steps=2, progress=lines.append)
    from localctx.backends.models.spec_reader import read_spec

    spec = read_spec(tiny_ref)
    assert cal.backend == TorchBackend().calibration_name()
    assert set(cal.formats) == set(POLICIES) == {"fp16", "int8", "int4", "k8v4", "kf16v8", "kf16v4", "fp16-windowed"}
    assert {str(POLICIES[f]) for f in ("k8v4", "kf16v8", "kf16v4")} == {"k8v4", "kf16v8", "kf16v4"}
    assert POLICIES["fp16-windowed"].evicts and not POLICIES["fp16-windowed"].quantized
    for fmt, fc in cal.formats.items():
        assert [p[0] for p in fc.points] == [17, 65]  # median cache length of the 4 steps after each fill
        for n, kv, seconds in fc.points:
            assert kv == cost.kv_bytes(spec, POLICIES[fmt], n) and seconds > 0
        assert fc.settings["policy"] == str(POLICIES[fmt]) and fc.settings["dtype"] == "float32"
    assert cal.prefill_tok_s > 0 and cal.weight_bytes == spec.weight_bytes
    assert any("64 tokens" in line for line in lines)
    close = calibrate(model=tiny_ref, contexts=(16, 18), rounds=1, steps=2, progress=lines.append)
    assert [p[0] for p in close.formats["fp16"].points] == [16, 18]  # 18 reached by the steps timed at 16


def _saved(name: str, hw_key: str, base: float) -> Calibration:
    cal = Calibration(backend=name, hardware_key=hw_key, model=SMOL.name, weight_bytes=SMOL.weight_bytes,
                      bandwidth_bytes_s=1e10, formats={"fp16": FormatCost(base, 1e-10)})
    calibration.save(cal)
    return cal


def test_planner_uses_a_torch_calibration_only_under_the_settings_it_was_measured_with(monkeypatch):
    _cpu_env(monkeypatch, "bf16", "int8", 1)
    ctx = planning_context("torch", SMOL)
    assert ctx.speed.calibration is None  # nothing measured yet: the roofline
    _saved("torch-cpu-bfloat16-int8-1t", ctx.hardware.key, base=0.02)
    ctx = planning_context("torch", SMOL)
    want = 1 / (0.02 + 1e-10 * cost.kv_bytes(SMOL, KVPolicy(), 2048))
    assert ctx.speed.decode_tok_s(SMOL, KVPolicy(), 2048) == pytest.approx(want)
    assert ctx.speed.basis(KVPolicy()).startswith("calibrated")
    _cpu_env(monkeypatch, "bf16", "int8", 3)  # another thread count: that measurement does not apply
    assert planning_context("torch", SMOL).speed.calibration is None
    assert planning_context("torch", SMOL, hardware="rtx4090").speed.calibration is None


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
