"""Calibrations: the fit, the store (user cache first, committed default second), and the speed model."""
import json

import pytest

from localctx.backends.machine import detect
from localctx.kvcache import calibration, cost
from localctx.kvcache.calibration import Calibration, FormatCost
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.speed import SpeedModel

SMOL = known_spec("smollm2-135m")
CPU = detect.named("cpu-24gb")


def test_fit_recovers_base_and_cost_per_byte():
    base, per_byte = 0.007, 9e-11
    points = [(n, b, base + per_byte * b) for n, b in ((256, 5_898_240), (4096, 94_371_840))]
    fc = FormatCost.fit(points, settings={"flash_attn": False})
    assert fc.base_s == pytest.approx(base) and fc.s_per_kv_byte == pytest.approx(per_byte)
    assert fc.step_s(5_898_240) == pytest.approx(base + per_byte * 5_898_240)
    assert fc.step_s(10_000_000_000) == pytest.approx(base + per_byte * 10_000_000_000)  # on along the line


def test_step_follows_the_measured_points_flat_below_and_never_cheaper_with_more_kv():
    # a CPU's step: flat over the first few hundred tokens, then linear; one noisy dip at 512
    points = [(128, 1_000, 0.0100), (256, 2_000, 0.0101), (512, 4_000, 0.0098), (1024, 8_000, 0.0130),
              (4096, 32_000, 0.0300)]
    fc = FormatCost.fit(points)
    assert fc.step_s(0) == fc.step_s(1_000) == pytest.approx(0.0100)  # the line would say less
    assert fc.step_s(1_500) == pytest.approx(0.01005)  # interpolated
    assert fc.step_s(4_000) == pytest.approx(0.0101)  # the dip is noise: never cheaper than less KV
    assert fc.step_s(6_000) == pytest.approx((0.0101 + 0.0130) / 2)
    last = (0.0300 - 0.0130) / 24_000  # past the longest point: the last stretch's slope (steeper than the fit)
    assert last > fc.s_per_kv_byte
    assert fc.step_s(64_000) == pytest.approx(0.0300 + last * 32_000)
    xs = range(0, 70_000, 500)
    assert all(fc.step_s(a) <= fc.step_s(b) for a, b in zip(xs, xs[1:]))


def test_fit_needs_two_context_lengths_and_never_makes_long_contexts_faster():
    with pytest.raises(ValueError, match="two or more context lengths"):
        FormatCost.fit([(256, 100, 0.01), (256, 100, 0.011)])
    noisy = FormatCost.fit([(256, 1_000, 0.012), (4096, 16_000, 0.010)])
    assert noisy.s_per_kv_byte == 0.0


def _cal(key: str, base: float) -> Calibration:
    return Calibration(backend="llamacpp", hardware_key=key, model="m", weight_bytes=SMOL.weight_bytes,
                       bandwidth_bytes_s=5e9, formats={"fp16": FormatCost(base, 1e-10)})


def test_save_and_load_round_trip_in_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    path = calibration.save(_cal("some-machine", 0.01))
    assert path.parent == tmp_path
    loaded = calibration.load("llamacpp", "some-machine")
    assert loaded.formats["fp16"].base_s == 0.01 and loaded.source == str(path)
    assert calibration.load("llamacpp", "another-machine") is None
    path.write_text("{not json")
    assert calibration.load("llamacpp", "some-machine") is None  # damaged and no default: uncalibrated


def test_the_committed_default_covers_this_cpu_class_and_a_user_measurement_overrides_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    key = detect.table()["cpu"]["profiles"]["cpu-24gb"]["calibration_key"]
    default = calibration.load("llamacpp", key)
    assert default is not None and default.source.startswith("assets/")
    assert set(default.formats) == {"fp16", "int8", "int4"}
    assert "load average" in default.note  # the note records the load it was measured under
    calibration.save(_cal(key, 0.5))
    assert calibration.load("llamacpp", key).formats["fp16"].base_s == 0.5


def test_on_this_cpu_class_quantized_kv_decodes_slower_at_8k_and_the_planner_knows():
    key = detect.table()["cpu"]["profiles"]["cpu-24gb"]["calibration_key"]
    speed = SpeedModel(CPU, calibration.load("llamacpp", key))
    fp16 = speed.decode_tok_s(SMOL, KVPolicy(), 8192)
    int4 = speed.decode_tok_s(SMOL, KVPolicy(k_bits=4, v_bits=4), 8192)
    assert cost.kv_bytes(SMOL, KVPolicy(k_bits=4, v_bits=4), 8192) < cost.kv_bytes(SMOL, KVPolicy(), 8192) / 3
    assert int4 < fp16  # fewer bytes, yet slower: dequantisation costs more than the bytes save here


def test_calibrated_projection_is_the_measured_line_for_the_calibration_model():
    cal = Calibration(backend="llamacpp", hardware_key="k", model=SMOL.name, weight_bytes=SMOL.weight_bytes,
                      bandwidth_bytes_s=5e9, formats={"fp16": FormatCost(0.007, 8e-11)})
    speed = SpeedModel(CPU, cal)
    for n in (256, 2048, 8192):
        expected = 0.007 + 8e-11 * cost.kv_bytes(SMOL, KVPolicy(), n)
        assert speed.step_seconds(SMOL, KVPolicy(), n) == pytest.approx(expected)
    assert speed.calibrated(KVPolicy()) and not speed.calibrated(KVPolicy(k_bits=8, v_bits=8))
    bigger = known_spec("llama-3-8b-q4")  # another model: its extra weight bytes cost bandwidth time
    extra = (bigger.weight_bytes - SMOL.weight_bytes) / CPU.bandwidth_bytes_s
    assert speed.step_seconds(bigger, KVPolicy(), 0) == pytest.approx(0.007 + extra)


def test_uncalibrated_projection_is_the_bandwidth_roofline():
    speed = SpeedModel(CPU)
    n = 4096
    expected = CPU.bandwidth_bytes_s / (SMOL.weight_bytes + cost.kv_bytes(SMOL, KVPolicy(), n))
    assert speed.decode_tok_s(SMOL, KVPolicy(), n) == pytest.approx(expected)
    assert "uncalibrated" in speed.basis(KVPolicy())


def test_max_cached_tokens_meets_the_target_exactly():
    cal = Calibration(backend="llamacpp", hardware_key="k", model=SMOL.name, weight_bytes=SMOL.weight_bytes,
                      bandwidth_bytes_s=5e9, formats={"fp16": FormatCost(0.006, 8e-11)})
    speed = SpeedModel(CPU, cal)
    held = speed.max_cached_tokens(SMOL, KVPolicy(), 100.0)
    assert speed.decode_tok_s(SMOL, KVPolicy(), held) >= 100.0 > speed.decode_tok_s(SMOL, KVPolicy(), held + 1)
    assert speed.max_cached_tokens(SMOL, KVPolicy(), 10_000.0) == 0


def test_calibration_json_rejects_unknown_formats():
    data = _cal("k", 0.01).to_dict()
    data["formats"]["fp8"] = data["formats"]["fp16"]
    with pytest.raises(ValueError, match="fp8"):
        Calibration.from_dict(json.loads(json.dumps(data)))


def test_a_windowed_policy_uses_its_own_cache_cost_where_one_was_measured():
    plain, windowed = FormatCost(0.01, 1e-10), FormatCost(0.01, 5e-10)
    base = dict(backend="torch-x", hardware_key="k", model="m", weight_bytes=SMOL.weight_bytes, bandwidth_bytes_s=5e9)
    both = SpeedModel(CPU, Calibration(formats={"fp16": plain, "fp16-windowed": windowed}, **base))
    only_fp16 = SpeedModel(CPU, Calibration(formats={"fp16": plain}, **base))
    window = KVPolicy.parse("fp16+sink4+win1024")
    kv = cost.kv_bytes(SMOL, window, 4096)
    assert both.step_seconds(SMOL, window, 4096) == pytest.approx(0.01 + 5e-10 * kv)
    assert both.step_seconds(SMOL, KVPolicy(), 1028) == pytest.approx(0.01 + 1e-10 * kv)  # unbounded: the plain cost
    assert only_fp16.step_seconds(SMOL, window, 4096) == pytest.approx(0.01 + 1e-10 * kv)  # none measured: fp16's
    assert both.calibrated(KVPolicy.parse("int8+sink4+win1024")) is False  # no int8 cost at all


def test_a_calibration_file_with_an_unknown_format_is_refused():
    d = _cal("k", 0.01).to_dict()
    d["formats"]["fp8"] = d["formats"]["fp16"]
    with pytest.raises(ValueError, match="unknown KV formats"):
        Calibration.from_dict(d)
