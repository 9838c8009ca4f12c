"""``localctx plan`` with a model's quality calibration (kvcache/quality_calibration.py) on a tiny GGUF:
under a --max-memory where only llama.cpp's q4_0 would hold the whole context, a calibration that
says q4_0 is over the --max-kld budget keeps the plan off it, and plan --json shows the measured
figure for each rejected format; a damaged calibration is ignored with a note; run and chat offer
calibration once for a lossy plan of an uncalibrated model."""
import json

import pytest
from gguf_tiny import TinyGGUF, write

pytest.importorskip("llama_cpp")

from localctx.app.session_options import PlannedSession, calibration_offer  # noqa: E402
from localctx.backends.machine.planner_inputs import planning_context  # noqa: E402
from localctx.backends.models.ref import resolve  # noqa: E402
from localctx.backends.models.spec_reader import read_spec  # noqa: E402
from localctx.kvcache import quality_calibration  # noqa: E402
from localctx.kvcache.plan import Plan  # noqa: E402
from localctx.kvcache.planner import PlanRequest, budget  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

FIGURES = {"int8": 0.002, "k8v4": 0.01, "kf16v4": 0.008, "int4": 0.9}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = TinyGGUF("llama", n_heads=2, n_kv_heads=1, head_dim=32, context=32768)
    return write(tmp_path_factory.mktemp("planq") / "llama.gguf", cfg, seed=3)


WINDOW = {"fp16+sink4+win1536": {"mean_kld": 0.7, "p99_kld": 4.0, "top1": 0.6, "ppl_delta_pct": 40.0, "tokens": 768,
                                  "score_from": 1541}}


def calibrate(model, figures=FIGURES, windows=None):
    cal = quality_calibration.QualityCalibration("llamacpp", quality_calibration.identity(model), {
        fmt: {"mean_kld": kld, "p99_kld": kld * 8, "top1": 1 - kld, "ppl_delta_pct": kld * 100, "tokens": 2048}
        for fmt, kld in figures.items()}, windows=windows or {})
    return quality_calibration.save(cal, model)


def only_int4_fits(model) -> str:
    """A --max-memory whose KV budget lies between q4_0's bytes and k8v4's for the whole context."""
    spec = read_spec(resolve(str(model)))
    ctx = planning_context("llamacpp", spec, hardware="cpu-24gb")
    need = {p: ctx.backend.kv_bytes(spec, KVPolicy.parse(p), spec.context_length) for p in ("int4", "k8v4")}
    probe = budget(ctx.hardware, spec, PlanRequest(max_memory=1 << 40), ctx.backend)
    cap = spec.weight_bytes + probe.runtime + 256 * 2**20 + (need["int4"] + need["k8v4"]) // 2
    assert cap * 0.05 < 256 * 2**20  # the safety margin stays its 256 MiB minimum
    return f"{cap}B"


def plan_json(cli, model, *more) -> dict:
    r = cli("plan", "-m", str(model), "--backend", "llamacpp", "--hardware", "cpu-24gb", "--json", *more)
    assert r.code == 0, r.err
    return json.loads(r.out)


def test_over_budget_q4_0_is_not_planned_where_only_it_holds_the_context(cli, tiny):
    cap = only_int4_fits(tiny)
    uncalibrated = plan_json(cli, tiny, "--max-memory", cap)["plan"]
    assert uncalibrated["policy"] == "int4" or "int4" in {r["policy"] for r in uncalibrated["rejected"]}
    calibrate(tiny)
    plan = plan_json(cli, tiny, "--max-memory", cap)["plan"]
    assert not plan["policy"].startswith("int4") and "win" in plan["policy"]  # a window instead
    rejected = {r["policy"]: r for r in plan["rejected"]}
    assert "over the --max-kld 0.05 budget" in rejected["int4"]["reason"]
    assert rejected["int4"]["quality"]["basis"] == "measured" and rejected["int4"]["quality"]["mean_kld"] == 0.9
    assert rejected["int8"]["quality"]["mean_kld"] == 0.002  # rejected for memory, its figure beside
    assert any("over the --max-kld 0.05 budget: int4 (0.900 measured)" in r for r in plan["reasons"])
    raised = plan_json(cli, tiny, "--max-memory", cap, "--max-kld", "1")["plan"]
    assert raised["policy"] == "int4" and raised["quality"]["mean_kld"] == 0.9


def test_plan_text_shows_the_chosen_figure_and_each_rejected_one(cli, tiny):
    calibrate(tiny)
    r = cli("plan", "-m", str(tiny), "--backend", "llamacpp", "--hardware", "cpu-24gb", "--max-memory",
            only_int4_fits(tiny))
    assert r.code == 0, r.err
    assert "int4: KLD 0.9000 nats/token (p99 7.200), top-1 10.0%, measured:" in r.out
    assert "quality: KLD 0.0020 nats/token" in r.out  # int8, refused for memory


def test_a_windowed_plan_quotes_the_measured_window_with_its_length_text_and_json(cli, tiny):
    """Past the trained context only a window holds the stream: plan names the window measured for this
    model (its length, the positions past it), as measured, and does not judge it against --max-kld."""
    calibrate(tiny, windows=WINDOW)
    plan = plan_json(cli, tiny, "--context", "65536")["plan"]
    assert plan["policy"].startswith("fp16+sink4+win")  # 0.7 nats over the 0.05 budget: quoted, still taken
    q = plan["window_quality"]
    assert (q["basis"], q["window"], q["tokens"], q["mean_kld"]) == ("measured", 1536, 768, 0.7)
    line = next(r for r in plan["reasons"] if r.startswith("window: "))
    assert "measured with window 1,536, scored at the 768 positions past it" in line
    assert "not judged against --max-kld" in line
    r = cli("plan", "-m", str(tiny), "--backend", "llamacpp", "--hardware", "cpu-24gb", "--context", "65536")
    assert r.code == 0, r.err
    assert "window    KLD 0.7000 nats/token (p99 4.000), top-1 60.0%, measured with window 1,536, scored at the " \
           "768 positions past it" in r.out
    calibrate(tiny)  # a calibration without a window: the plan says the window is not measured
    bare = plan_json(cli, tiny, "--context", "65536")["plan"]
    assert bare["window_quality"] is None
    assert any(r.startswith("window: KL divergence of a fp16+sink4 window not measured") for r in bare["reasons"])


def test_a_damaged_calibration_is_ignored_with_a_note(cli, tiny):
    path = calibrate(tiny)
    quality_calibration.write_private(path, "{not json")
    plan = plan_json(cli, tiny)["plan"]
    assert any(r.startswith("note: quality calibration") and "ignored (damaged" in r for r in plan["reasons"])
    assert all((r["quality"] or {}).get("basis") != "measured" for r in plan["rejected"])


def test_run_and_chat_offer_calibration_once_for_a_lossy_plan_of_an_uncalibrated_model(tiny, tmp_path):
    model = tmp_path / "copy.gguf"
    model.write_bytes(tiny.read_bytes())
    ref, spec = resolve(str(model)), read_spec(resolve(str(model)))
    lossy = PlannedSession(ref, spec, Plan.fixed("llamacpp", spec, KVPolicy.parse("int8"), 1024))
    exact = PlannedSession(ref, spec, Plan.fixed("llamacpp", spec, KVPolicy(), 1024))
    assert calibration_offer(exact) is None
    line = calibration_offer(lossy)
    assert line and "--calibrate-quality -m" in line and "\n" not in line
    assert calibration_offer(lossy) is None  # once
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny.read_bytes() + b"\0")
    calibrate(other)
    plan = Plan.fixed("llamacpp", spec, KVPolicy.parse("int8"), 1024)
    plan.quality = {"basis": "measured"}
    planned = PlannedSession(resolve(str(other)), spec, plan)
    assert calibration_offer(planned) is None  # measured: nothing to offer


def test_run_json_stats_carry_the_chosen_formats_figure_and_the_offer_is_made_once(cli, tiny, tmp_path):
    model = tmp_path / "run.gguf"
    model.write_bytes(tiny.read_bytes())
    argv = ("run", "-m", str(model), "--backend", "llamacpp", "--kv", "int8", "--context", "256",
            "--max-tokens", "2", "--raw", "--json", "the river")
    first = cli(*argv)
    assert first.code == 0, first.err
    assert json.loads(first.out)["stats"]["kv_quality"] is None  # nothing measured, no prior for this shape
    assert first.err.count("--calibrate-quality") == 1
    calibrate(model)
    second = cli(*argv)
    assert second.code == 0, second.err
    assert json.loads(second.out)["stats"]["kv_quality"]["mean_kld"] == 0.002
    assert "--calibrate-quality" not in second.err


def test_calibrate_quality_measures_every_format_and_the_planned_window_on_the_positions_it_names(cli, tiny,
                                                                                                  monkeypatch):
    """The real command on a tiny GGUF (a short text): it says what it measures, the saved file holds a
    measured figure per format llama.cpp offers over exactly those positions, and q4_0 costs more than q8_0;
    the window the planner takes here (fp16 keys: llama.cpp shifts no quantized keys) is cut to half the
    text and scored only past its sinks + window, and equals an evaluation scored from there."""
    from localctx.backends.evaluation import calibrate_quality
    from localctx.backends.evaluation.tasks import PerplexityTask
    from localctx.backends.llamacpp.evaluate import LlamaCppEvaluator, evaluate

    from localctx.backends import registry

    monkeypatch.setattr(calibrate_quality, "TOKENS", 512)
    monkeypatch.setattr(registry, "auto_name", lambda: "llamacpp")  # as on a CPU host with a working build
    r = cli("plan", "-m", str(tiny), "--calibrate-quality", "--json")  # no --backend: the one run would use
    assert r.code == 0, r.err
    assert "on llamacpp (the backend run and chat use here; --backend picks another)" in r.err
    assert "512 tokens of built-in text (pydoc_data.topics), every 2nd prediction scored: 256 positions from 1 to " \
           "512 of the 32,768 trained" in r.err
    assert "then the window planned here, fp16+sink4+win256, scored only past its 260 cached tokens: 126 positions " \
           "from 261 to 512" in r.err
    cal, _ = quality_calibration.load(tiny, "llamacpp")
    assert set(cal.figures) == {"int8", "k8v4", "kf16v4", "int4"}
    assert all(f["tokens"] == 256 for f in cal.figures.values())
    assert 0 < cal.figures["int8"]["mean_kld"] < cal.figures["int4"]["mean_kld"]
    assert "256 positions" in cal.note and "126 positions from 261" in cal.note
    window = cal.windows["fp16+sink4+win256"]
    assert set(cal.windows) == {"fp16+sink4+win256"} and window["tokens"] == 126 and window["score_from"] == 261
    assert window["mean_kld"] > 0  # past the window the evicted tokens change the predictions
    reports = evaluate(LlamaCppEvaluator(resolve(str(tiny))), [KVPolicy.parse("fp16+sink4+win256")],
                       PerplexityTask(513, 256, score_from=261, stride=2), None)
    assert reports[1].divergence.scored == 126
    assert window["mean_kld"] == pytest.approx(reports[1].divergence.mean_kld, rel=1e-6)
    early = evaluate(LlamaCppEvaluator(resolve(str(tiny))), [KVPolicy.parse("fp16+sink4+win256")],
                     PerplexityTask(261, 256, stride=2), None)[1].divergence
    assert early.mean_kld == 0  # inside the window nothing is evicted: scoring there would dilute the figure
