"""The planner against measured quality (kvcache/quality.py) and measured speed of K/V splits:
a format whose verdict on the backend breaks the goals is never chosen and the reason says so,
a safer split is preferred, and kf16v8 is considered only where calibration measured it."""
import json

import pytest

from localctx.backends.machine import detect
from localctx.backends.fake.backend import FakeBackend
from localctx.kvcache import quality
from localctx.kvcache.calibration import Calibration, FormatCost
from localctx.kvcache.errors import UserError
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.planner import BackendView, PlanRequest, plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.speed import SpeedModel

SPEC = known_spec("llama-3.1-70b-q4")
HW = detect.named("m2-max-64gb")
SOURCE = "localctx eval --backend fake --kv ... (fixture)"


def table(tmp_path, verdicts: dict) -> quality.QualityTable:
    rows = {fmt: {"perplexity_delta_pct": ppl, "passkey_delta_points": passkey, "source": SOURCE}
            for fmt, (ppl, passkey) in verdicts.items()}
    path = tmp_path / "kv_quality.json"
    path.write_text(json.dumps({"about": "fixture", "verdicts": {"fake": rows}}))
    return quality.load(path)


def view(quality_table) -> BackendView:
    return BackendView("fake", FakeBackend(0).capabilities().refusals, quality_table=quality_table)


def test_a_split_that_meets_the_goals_is_preferred_over_int4_that_breaks_them(tmp_path):
    verdicts = table(tmp_path, {"k8v4": (0.4, 0), "int4+res128": (3.5, 0), "int4": (2.0, -11.1)})
    p = plan(HW, SPEC, PlanRequest(context=40960), view(verdicts))  # int8 and k8v4 do not fit here
    rejected = {r.policy: r.reason for r in p.rejected}
    assert "perplexity +3.50%" in rejected["int4+res128"] and "perplexity over +3%" in rejected["int4+res128"]
    assert "passkey loss" in rejected["int4"] and "perplexity over" not in rejected["int4"]
    assert quality.format_key(p.policy) not in ("int4+res128", "int4")  # never a format measured to break the goals
    q = plan(HW, SPEC, PlanRequest(context=32768), view(verdicts))
    assert str(q.policy) == "k8v4"
    assert any("keys at 8 bits, values at 4" in r and "measured on fake: perplexity +0.40%" in r for r in q.reasons)


def test_where_every_quantized_format_breaks_the_goals_the_plan_is_a_full_precision_window(tmp_path):
    bad = {fmt: (5.0, -20) for fmt in ("int8", "k8v4", "int4+res128", "int4", "kf16v8", "kf16v4")}
    p = plan(HW, SPEC, PlanRequest(context=40960), view(table(tmp_path, bad)))
    assert p.policy.evicts and not p.policy.quantized
    assert sum("breaks the quality goals" in r.reason for r in p.rejected) >= 4


def test_an_int8_verdict_is_held_to_the_8_bit_goal():
    verdict = quality.Verdict("fake", "int8", 0.6, 0, SOURCE)
    assert "perplexity over +0.5%" in verdict.broken_goals(KVPolicy.parse("int8"))
    assert quality.Verdict("fake", "k8v4", 0.6, 0, SOURCE).broken_goals(KVPolicy.parse("k8v4")) is None


def test_the_shipped_table_holds_measured_rows_and_refuses_llamacpps_q4_0_keys():
    shipped = quality.load()
    broken = set()
    for backend, formats in shipped.verdicts.items():
        for fmt, verdict in formats.items():
            assert verdict.source.startswith("docs/") and ("localctx eval" in verdict.source
                                                           or "benchmarks/quality/quality_tables.py" in verdict.source)
            if verdict.broken_goals(KVPolicy.parse(fmt)):
                broken.add((backend, fmt))
    assert broken == {("llamacpp", "int4")}  # q4_0 keys: +8.32% perplexity, 8/9 passkey on SmolLM2 (docs/quality.md)
    assert shipped.verdict("torch", KVPolicy.parse("int4+res128+sink4+win2048")).perplexity_delta_pct == 0.27


@pytest.mark.parametrize("text, words", [('{"verdicts": {"fake": {"int8": {}}}}', "not a KV quality table"),
                                         ('{"verdicts": {"fake": {"int8+win64": {"perplexity_delta_pct": 0, '
                                          '"passkey_delta_points": 0, "source": "x"}}}}', "without a window")])
def test_a_broken_table_is_one_line_naming_the_fix(tmp_path, text, words):
    path = tmp_path / "kv_quality.json"
    path.write_text(text)
    with pytest.raises(UserError, match=words):
        quality.load(path)


def calibration(**formats) -> Calibration:
    smol = known_spec("smollm2-135m")
    cpu = detect.named("cpu-24gb")
    return Calibration(backend="fake", hardware_key=cpu.key, model=smol.name, weight_bytes=smol.weight_bytes,
                       bandwidth_bytes_s=cpu.bandwidth_bytes_s,
                       formats={name: FormatCost(base, per_byte) for name, (base, per_byte) in formats.items()})


def test_kf16v8_is_chosen_only_where_calibration_measured_it_faster():
    smol, cpu = known_spec("smollm2-135m"), detect.named("cpu-24gb")
    cal = calibration(fp16=(0.006, 8e-11), int8=(0.006, 6e-11), int4=(0.006, 6e-11), kf16v8=(0.006, 1e-11))
    target = PlanRequest(context=8192, min_tok_s=100)
    p = plan(cpu, smol, target, view(quality.NO_VERDICTS), SpeedModel(cpu, cal))
    assert str(p.policy) == "kf16v8"
    assert [r.policy for r in p.rejected][:1] == ["fp16"] and "--min-tok-s" in p.rejected[0].reason
    unmeasured = calibration(fp16=(0.006, 8e-11), int8=(0.006, 1e-11), int4=(0.006, 1e-11))
    q = plan(cpu, smol, target, view(quality.NO_VERDICTS), SpeedModel(cpu, unmeasured))
    assert str(q.policy) == "int8" and "kf16v8" not in {r.policy for r in q.rejected}


def test_under_a_speed_target_an_unmeasured_split_is_not_taken_on_the_roofline():
    smol, cpu = known_spec("smollm2-135m"), detect.named("cpu-24gb")
    cal = calibration(fp16=(0.006, 8e-11), int8=(0.006, 4e-10), int4=(0.006, 1e-9))  # no split timed
    p = plan(cpu, smol, PlanRequest(context=8192, min_tok_s=100), view(quality.NO_VERDICTS), SpeedModel(cpu, cal))
    assert not p.policy.split
    unmeasured = {r.policy for r in p.rejected if "decode speed is not measured on fake" in r.reason}
    assert {"k8v4", "kf16v8+sink4+winN", "k8v4+sink4+winN"} <= unmeasured


def test_a_verdict_without_a_passkey_measurement_is_judged_on_perplexity_alone_and_says_so(tmp_path):
    verdicts = table(tmp_path, {"k8v4": (0.37, None), "int4": (6.67, None)})
    fake = verdicts.for_backend("fake")
    assert fake.refusal(KVPolicy.parse("k8v4")) is None
    assert "passkey not measured" in fake.note(KVPolicy.parse("k8v4"))
    assert "perplexity over +3%" in fake.refusal(KVPolicy.parse("int4"))
    assert "passkey loss" not in fake.refusal(KVPolicy.parse("int4"))
