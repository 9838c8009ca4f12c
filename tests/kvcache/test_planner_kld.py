"""The planner's quality budget (kvcache/kld_quality.py): a format whose KL divergence for this model is
over --max-kld is never chosen, even where it alone would hold the whole context, and the plan says
which format was refused, measured or prior, and what it did instead; the calibration cache
(kvcache/quality_calibration.py) is owner-only and a damaged or mismatched file is ignored with a note."""
import json
import os
import stat
from dataclasses import replace

import pytest

from localctx.backends.fake.backend import FakeBackend
from localctx.backends.machine import detect
from localctx.kvcache import kld_quality, quality_calibration
from localctx.kvcache.errors import UserError
from localctx.kvcache.kld_quality import KldFigure, KldTable
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.planner import BackendView, PlanRequest, budget, plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.quality import format_key

SPEC = known_spec("llama-3.1-70b-q4")
HW = detect.named("m2-max-64gb")  # at 40,960 tokens int8 and k8v4 do not fit, int4 does


def fig(fmt: str, kld: float, basis: str = "measured") -> KldFigure:
    return KldFigure(fmt, kld, kld * 10, 1 - kld, basis, "fixture calibration", 2048)


def view(measured: dict, priors: dict | None = None) -> BackendView:
    return BackendView("fake", FakeBackend(0).capabilities().refusals, kld=KldTable(measured, priors or {}))


def test_int4_over_budget_is_not_chosen_where_only_it_holds_the_whole_context():
    within = plan(HW, SPEC, PlanRequest(context=40960), view({"int4": fig("int4", 0.05)}))
    assert str(within.policy).startswith("int4")  # without the budget's refusal int4 is the plan here
    over = {f: fig(f, 0.9) for f in ("int4", "int4+res128")}
    p = plan(HW, SPEC, PlanRequest(context=40960, max_kld=0.1), view(over))
    assert format_key(p.policy) not in ("int4", "int4+res128")
    assert p.policy.evicts  # a window instead: nothing lossy within budget holds the whole context
    rejected = {r.policy: r for r in p.rejected}
    for fmt in ("int4", "int4+res128"):
        assert "over the --max-kld 0.1 budget" in rejected[fmt].reason and "measured" in rejected[fmt].reason
        assert rejected[fmt].quality["mean_kld"] == 0.9 and rejected[fmt].quality["basis"] == "measured"
    assert any("over the --max-kld 0.1 budget: int4+res128 (0.900 measured), int4 (0.900 measured)" in r
               and "a window keeps the context within budget" in r for r in p.reasons)
    assert {r["policy"]: r["quality"] for r in p.to_dict()["rejected"]}["int4"]["source"] == "fixture calibration"


def test_a_raised_budget_lets_the_same_figure_through_and_the_plan_quotes_it():
    p = plan(HW, SPEC, PlanRequest(context=40960, max_kld=1.0), view({"int4+res128": fig("int4+res128", 0.9)}))
    assert str(p.policy) == "int4+res128"
    assert p.quality["mean_kld"] == 0.9 and p.to_dict()["quality"]["basis"] == "measured"
    assert any("within the --max-kld 1 budget" in r for r in p.reasons)


def test_measured_figures_win_over_priors_and_priors_say_so():
    table = KldTable({"int8": fig("int8", 0.001)}, {"int8": fig("int8", 5.0, "prior"), "k8v4": fig("k8v4", 0.02, "prior")})
    assert table.figure(KVPolicy.parse("int8")).basis == "measured"
    assert table.figure(KVPolicy.parse("k8v4+sink4+win512")).basis == "prior"  # a window's format is its precision
    p = plan(HW, SPEC, PlanRequest(context=36864), view({}, {"int8": fig("int8", 5.0, "prior")}))
    rejected = {r.policy: r for r in p.rejected}
    assert "prior" in rejected["int8"].reason and "over the --max-kld" in rejected["int8"].reason


def test_nothing_within_budget_and_no_window_room_refuses_and_names_the_budget():
    over = {f: fig(f, 2.0) for f in ("int8", "k8v4", "kf16v4", "int4", "int4+res128")}
    probe = budget(HW, SPEC, PlanRequest(max_memory=int(60e9)), view(over))
    fixed = probe.weights + probe.runtime
    cap = int((fixed + 10e6) / (1 - 0.05))  # a KV budget of ~10 MB: a full-precision window under 128 tokens
    with pytest.raises(UserError) as err:
        plan(HW, SPEC, PlanRequest(context=40960, max_memory=cap), view(over))
    assert "over the --max-kld 0.05 budget: int8 (2.000 measured)" in str(err.value)
    assert "and no window fits" in str(err.value) and "raise --max-kld" in str(err.value)


def test_a_non_positive_budget_is_one_line():
    with pytest.raises(UserError, match="--max-kld 0 must be positive"):
        plan(HW, SPEC, PlanRequest(max_kld=0), view({}))


def test_priors_are_keyed_by_backend_format_head_dim_and_size_class():
    data = {"priors": {"llamacpp/int4/hd64/300M-1.2B": {"mean_kld": 0.7, "p99_kld": 5.0, "top1": 0.8,
                                                       "model": "Qwen", "command": "localctx plan ..."}}}
    table = kld_quality.parse_priors(data, "fixture")
    qwen = known_spec("smollm2-135m")
    assert kld_quality.priors_for("llamacpp", replace(qwen, head_dim=64, n_params=494_000_000), table)["int4"].basis == "prior"
    assert kld_quality.priors_for("llamacpp", replace(qwen, head_dim=128, n_params=494_000_000), table) == {}
    assert kld_quality.priors_for("torch", replace(qwen, head_dim=64, n_params=494_000_000), table) == {}
    assert kld_quality.priors_for("llamacpp", replace(qwen, head_dim=64, n_params=135_000_000), table) == {}
    with pytest.raises(UserError, match="not a KL divergence table"):
        kld_quality.parse_priors({"priors": {"llamacpp/int4": {}}}, "fixture")


def test_the_committed_priors_parse():
    assert all(f.basis == "prior" and f.source for f in kld_quality.load_priors().values())


def calibration(model) -> quality_calibration.QualityCalibration:
    return quality_calibration.QualityCalibration(
        "llamacpp", quality_calibration.identity(model),
        {"int4": {"mean_kld": 0.8, "p99_kld": 6.0, "top1": 0.7, "ppl_delta_pct": 200.0, "tokens": 2048}})


def test_a_calibration_is_written_owner_only_and_read_back_for_the_same_file_and_backend(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(3000))
    path = quality_calibration.save(calibration(model), model)
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    cal, where = quality_calibration.load(model, "llamacpp")
    assert where == str(path) and cal.kld_figures(where)["int4"].mean_kld == 0.8
    assert quality_calibration.load(model, "torch") == (None, "")  # another backend: none cached


@pytest.mark.parametrize("damage", ["truncated", "wrong identity", "bad format"])
def test_a_damaged_or_mismatched_calibration_is_ignored_with_a_one_line_note(tmp_path, damage):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(3000))
    path = quality_calibration.save(calibration(model), model)
    data = json.loads(path.read_text())
    if damage == "truncated":
        text = path.read_text()[:40]
    elif damage == "wrong identity":
        data["model"]["head_sha256"] = "0" * 64
        text = json.dumps(data)
    else:
        data["figures"] = {"int4+win64": data["figures"]["int4"]}
        text = json.dumps(data)
    quality_calibration.write_private(path, text)
    cal, note = quality_calibration.load(model, "llamacpp")
    assert cal is None and note.startswith("note: quality calibration") and "ignored" in note
    assert "\n" not in note and "--calibrate-quality" in note


def test_a_changed_model_file_has_no_calibration(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(3000))
    quality_calibration.save(calibration(model), model)
    model.write_bytes(b"GGUF" + bytes(3001))  # size (and mtime) change: another identity, another file
    assert quality_calibration.load(model, "llamacpp") == (None, "")


# -- windows: measured by the calibration with the longest window its text allows, quoted, not judged ----------

def test_planned_window_is_the_planners_window_shape_cut_to_half_the_text():
    from localctx.kvcache.planner import planned_window

    probe = replace(SPEC, context_length=40960)  # on this machine only int4 holds the whole trained context
    forced = plan(HW, probe, PlanRequest(context=81920), view({}))  # past the trained context: a window
    assert forced.policy.evicts
    w = planned_window(HW, probe, view({}), None, 3072)
    assert replace(w, window=forced.policy.window) == forced.policy  # the same shape, the window cut
    assert w.window == 1536 and w.capacity() == 1536 + w.sinks
    assert planned_window(HW, probe, view({}), None, 200) is None  # half of 200 is under the 128-token minimum


def window_fig(kld: float, window: int = 1024) -> KldFigure:
    return KldFigure(f"fp16+sink4+win{window}", kld, kld * 10, 1 - kld, "measured", "fixture calibration", 900,
                     window=window)


def test_a_windowed_plan_quotes_the_measured_window_and_does_not_judge_it():
    windowed = replace(SPEC, context_length=8192)  # 40,960 tokens are past the trained context: a window
    table = view({}).kld
    p = plan(HW, windowed, PlanRequest(context=40960), view({}))
    assert p.policy.evicts and p.window_quality is None
    assert any(r.startswith("window: KL divergence of a") and "not measured" in r for r in p.reasons)
    measured = BackendView("fake", FakeBackend(0).capabilities().refusals,
                           kld=replace(table, windows={"fp16+sink4": window_fig(2.5)}))
    q = plan(HW, windowed, PlanRequest(context=40960, max_kld=0.05), measured)
    assert str(q.policy).startswith("fp16+sink4+win") and q.policy.window > 1024  # 2.5 nats: still taken
    assert q.window_quality["mean_kld"] == 2.5 and q.window_quality["window"] == 1024
    assert q.to_dict()["window_quality"]["basis"] == "measured"
    line = next(r for r in q.reasons if r.startswith("window: "))
    assert "measured with window 1,024, scored at the 900 positions past it" in line
    assert f"this plan keeps {q.policy.window:,} tokens" in line and "not judged against --max-kld" in line
    other_shape = BackendView("fake", FakeBackend(0).capabilities().refusals,
                              kld=replace(table, windows={"int8+sink4": window_fig(0.1)}))
    assert plan(HW, windowed, PlanRequest(context=40960), other_shape).window_quality is None


def windowed_calibration(model, score_from: int = 1030) -> quality_calibration.QualityCalibration:
    return replace(calibration(model), windows={"fp16+sink4+win1024": {
        "mean_kld": 0.3, "p99_kld": 2.0, "top1": 0.8, "ppl_delta_pct": 5.0, "tokens": 900, "score_from": score_from}})


def test_a_calibrations_window_is_read_back_with_its_length_and_scored_positions(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(3000))
    quality_calibration.save(windowed_calibration(model), model)
    cal, where = quality_calibration.load(model, "llamacpp")
    fig = cal.window_figures(where)["fp16+sink4"]
    assert (fig.window, fig.tokens, fig.mean_kld, fig.basis) == (1024, 900, 0.3, "measured")
    assert cal.windows["fp16+sink4+win1024"]["score_from"] == 1030


@pytest.mark.parametrize("damage", ["scored inside the window", "version 1"])
def test_a_window_scored_inside_it_or_an_old_file_is_ignored(tmp_path, damage):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(3000))
    path = quality_calibration.save(windowed_calibration(model, score_from=1028), model)
    if damage == "version 1":
        data = json.loads(path.read_text())
        data["version"] = 1
        del data["windows"]
        data["windows"] = {}
        quality_calibration.write_private(path, json.dumps(data))
    cal, note = quality_calibration.load(model, "llamacpp")
    assert cal is None and "ignored" in note and "\n" not in note
    assert ("older localctx" in note) == (damage == "version 1")
