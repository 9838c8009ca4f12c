"""localctx bench, the pure parts: settings, the interleaved schedule, prompt fitting, statistics, goals."""
from __future__ import annotations

import pytest

from localctx.app.bench import goals
from localctx.app.bench.measure import Sample
from localctx.app.bench.prompt import fit_text
from localctx.app.bench.results import paired_ratio, headline, summary
from localctx.app.bench.schedule import over_budget, schedule
from localctx.app.bench.settings import BenchSettings, Series, parse_contexts, policies_from
from localctx.kvcache.errors import UserError


def test_contexts_parse_with_k_suffix_sorted_and_unique():
    assert parse_contexts("8k, 256,1k,2k,1024") == [256, 1024, 2048, 8192]


@pytest.mark.parametrize("text", ["", "abc", "1m", "32", "256,,x"])
def test_bad_contexts_are_user_errors(text):
    with pytest.raises(UserError, match="--contexts"):
        parse_contexts(text)


def test_policies_are_canonical_and_deduplicated():
    assert policies_from(["f16", "INT4", "fp16", "win64+sink4+int8"]) == ["fp16", "int4", "int8+sink4+win64"]
    with pytest.raises(UserError):
        policies_from(["int3"])


def test_settings_refuse_contexts_without_room_for_a_prompt():
    s = BenchSettings(model=None, backends=["fake"], policies=["fp16"], contexts=[64], gen_tokens=64)
    with pytest.raises(UserError, match="gen-tokens"):
        s.check()


def test_schedule_interleaves_every_series_at_each_context_and_rotates():
    base = Series("llama-cpp-python", "fp16", baseline=True)
    full, win = Series("llamacpp", "fp16"), Series("torch", "int8+sink4+win256")
    plan = schedule([base, full, win], [256, 8192, 16384], runs=2, trained=8192)
    blocks: dict[tuple[int, int], list[str]] = {}
    for run, ctx, s in plan:
        blocks.setdefault((run, ctx), []).append(s.key)
    assert [k for k in blocks] == [(0, 256), (0, 8192), (0, 16384), (1, 256), (1, 8192), (1, 16384)]
    for (run, ctx), keys in blocks.items():
        # past the trained length only the windowed series runs; everything else runs beside the baseline
        want = {win.key} if ctx > 8192 else {base.key, full.key, win.key}
        assert set(keys) == want and len(keys) == len(want)
    firsts = [keys[0] for (run, ctx), keys in blocks.items() if ctx <= 8192]
    assert len(set(firsts)) > 1  # the order rotates, so no series is always measured first


def test_fit_text_takes_the_longest_prefix_within_the_budget():
    text = "one two three four five six seven eight nine ten " * 3

    def words(s: str) -> int:
        return len(s.split())

    out = fit_text(words, 7, text)
    assert text.startswith(out) and words(out) == 7
    assert words(text[: len(out) + 1]) == 8  # one more character would start the 8th word
    longer = fit_text(words, 100, text)  # past the text: the text repeats
    assert words(longer) == 100


def test_summary_and_spread():
    s = summary([10.0, 12.0, 8.0])
    assert (s["median"], s["min"], s["max"], s["spread_pct"]) == (10.0, 8.0, 12.0, 20.0)


def test_paired_ratio_uses_run_by_run_ratios():
    mine = [Sample(decode_tok_s=x) for x in (10.0, 20.0, 30.0)]
    base = [Sample(decode_tok_s=x) for x in (20.0, 20.0, 60.0)]
    assert paired_ratio(mine, base, "decode_tok_s") == pytest.approx(0.5)  # median of (0.5, 1.0, 0.5)
    assert paired_ratio(mine, base[:2], "decode_tok_s") == pytest.approx(20.0 / 20.0)  # medians when unpaired
    assert paired_ratio(mine, [], "decode_tok_s") is None


def _entry(backend: str, policy: str, decode: dict[int, float], baseline: bool = False) -> dict:
    key = "llama-cpp-python" if baseline else f"{backend}/{policy}"
    points = [{"context": c, "status": "ok", "decode_tok_s": {"median": v}} for c, v in decode.items()]
    return {"key": key, "label": key, "backend": backend, "policy": policy, "baseline": baseline, "status": "ok",
            "points": points}


def test_headline_and_goals_from_measured_points():
    entries = [
        _entry("llama-cpp-python", "fp16", {256: 100.0, 8192: 32.0}, baseline=True),
        _entry("torch", "fp16", {256: 50.0, 8192: 20.0}),
        _entry("torch", "int4", {256: 40.0, 8192: 25.0}),
        _entry("torch", "int8+sink4+win1024", {256: 40.0, 8192: 36.0}),
        _entry("torch", "fp16+sink4+win1024", {256: 40.0, 8192: 30.0}),
    ]
    head = headline(entries, [256, 8192], trained=8192)
    ratios = {r["series"]: r["ratio"] for r in head["rows"]}
    assert ratios["llama-cpp-python"] == pytest.approx(0.32)
    assert ratios["torch/int8+sink4+win1024"] == pytest.approx(0.9)
    versus = {r["series"]: r["vs_baseline_ratio"] for r in head["rows"]}
    assert versus["torch/int8+sink4+win1024"] == pytest.approx(0.9 / 0.32)
    rows, comparisons = goals.evaluate(entries, head, planner_picks=None)
    status = {g["goal"].split()[0]: g["status"] for g in rows}
    assert status["policies"] == "fails"  # fp16+sink4+win1024 holds only 0.75
    assert status["quantized"] == "holds"  # torch int4 25 ≥ fp16 20 at 8k
    assert status["the"] == "not measured"  # no planner picks given
    pairs = {(c["policy"], c["fp16_policy"]): c["ratio"] for c in comparisons}
    assert pairs[("int4", "fp16")] == pytest.approx(1.25)
    assert pairs[("int8+sink4+win1024", "fp16+sink4+win1024")] == pytest.approx(1.2)


def test_window_goal_also_says_how_the_cost_moves_once_the_window_is_full():
    entries = [
        _entry("llamacpp", "fp16+sink4+win1024", {256: 100.0, 1024: 80.0, 2048: 76.0, 8192: 72.0}),
        _entry("llamacpp", "fp16+sink4+win252", {256: 100.0, 1024: 99.0, 8192: 95.0}),
    ]
    head = headline(entries, [256, 1024, 2048, 8192], trained=8192)
    assert goals.once_full(entries[0], 8192) == (2048, pytest.approx(72.0 / 76.0))  # 1,028 tokens fill by 2k
    assert goals.once_full(entries[1], 8192) == (256, pytest.approx(0.95))
    verdict = goals.window_goal(entries, head)
    assert verdict["status"] == "fails"  # 0.72 from 256 tokens, whatever happens once full
    assert "llamacpp/fp16+sink4+win1024 0.72 (the window fills by 2k; 8k ÷ 2k = 0.95)" in verdict["detail"]
    assert verdict["detail"].endswith("llamacpp/fp16+sink4+win252 0.95")  # full at 256: nothing to add
    assert verdict["detail"].count("the window fills") == 1


def test_planner_goal_flags_a_quantized_pick_that_measured_slower():
    comparisons = [{"backend": "llamacpp", "policy": "int4", "ratio": 0.4}]
    picks = [{"backend": "llamacpp", "context": 8192, "policy": "int4", "fp16_fits": True}]
    assert goals.planner_goal(picks, comparisons)["status"] == "fails"
    picks[0]["fp16_fits"] = False  # quantized because fp16 does not fit: allowed, but nothing forced was asked
    assert goals.planner_goal(picks, comparisons)["status"] == "not measured"
    assert goals.planner_speed_goal(None, [])["status"] == "not measured"


FORCED_ENTRIES = [_entry("llamacpp", "fp16", {8192: 40.0}), _entry("llamacpp", "int8", {8192: 30.0}),
                  _entry("llamacpp", "int4", {8192: 20.0}), _entry("llamacpp", "fp16+sink4+win1024", {8192: 60.0})]
FREE_PICKS = [{"backend": "llamacpp", "context": 8192, "policy": "fp16", "fp16_fits": True}]


def _memory_pick(policy: str) -> dict:
    return {"backend": "llamacpp", "context": 8192, "forced": "memory", "max_memory": 10**9, "kv_budget": 10**8,
            "fitting": ["int8", "int4", "fp16+sink4+win1024"], "policy": policy}


def _speed_pick(policy: str) -> dict:
    return {"backend": "llamacpp", "context": 8192, "forced": "speed", "min_tok_s": 42.0, "policy": policy}


@pytest.mark.parametrize("pick, status", [
    (_memory_pick("int8"), "holds"),  # the fastest format under the cap that keeps every token
    (_memory_pick("int4"), "fails"),  # int8 fits too, is more precise, and measured 1.5× faster
    (_memory_pick("none (nothing fits)"), "holds"),  # refusing picks nothing slower
    (_memory_pick("int4+sink4+win512"), "not measured"),  # the bench has no such series
])
def test_planner_goal_judges_memory_capped_picks_against_the_bench(pick, status):
    verdict = goals.planner_goal(FREE_PICKS, [], [pick], FORCED_ENTRIES)
    assert verdict["status"] == status, verdict["detail"]
    if status == "fails":
        assert "slower than an alternative: llamacpp 8k memory → int4 20.0 tok/s, but int8 fits" in verdict["detail"]


@pytest.mark.parametrize("pick, status", [
    (_speed_pick("fp16+sink4+win1024"), "holds"),  # 1.5× fp16: meets a target above fp16
    (_speed_pick("int8"), "fails"),  # picked for speed, measured slower than the fp16 it replaced
    (_speed_pick("none (nothing meets it)"), "holds"),
    (_speed_pick("int8+sink4+win512"), "not measured"),
])
def test_planner_speed_goal_judges_picks_against_fp16(pick, status):
    verdict = goals.planner_speed_goal([pick], FORCED_ENTRIES)
    assert verdict["status"] == status, verdict["detail"]


def test_memory_pick_is_compared_with_formats_as_precise_that_evict_as_it_does():
    # the windowed fp16 fits and is faster, but it drops tokens: a pick that keeps every token is judged
    # against the formats that keep every token
    assert goals.forced_pick_verdict(_memory_pick("int8"), FORCED_ENTRIES)[0] == "good"
    lossy = {**_memory_pick("fp16+sink4+win1024"), "fitting": ["int8", "fp16+sink4+win1024"]}
    assert goals.forced_pick_verdict(lossy, FORCED_ENTRIES)[0] == "good"
    # a less precise format that measured faster does not make a more precise pick bad
    faster_int4 = FORCED_ENTRIES[:1] + [_entry("llamacpp", "int8", {8192: 30.0}), _entry("llamacpp", "int4", {8192: 40.0})]
    assert goals.forced_pick_verdict(_memory_pick("int8"), faster_int4)[0] == "good"
    assert goals.forced_pick_verdict(_memory_pick("int4"), faster_int4)[0] == "good"
    # within the tolerance: 29 against 30 is noise, 28 is not
    close = FORCED_ENTRIES[:1] + [_entry("llamacpp", "int8", {8192: 30.0}), _entry("llamacpp", "int4", {8192: 29.0})]
    assert goals.forced_pick_verdict(_memory_pick("int4"), close)[0] == "good"
    far = FORCED_ENTRIES[:1] + [_entry("llamacpp", "int8", {8192: 30.0}), _entry("llamacpp", "int4", {8192: 28.0})]
    assert goals.forced_pick_verdict(_memory_pick("int4"), far)[0] == "bad"


def test_time_budget_stops_only_between_whole_runs():
    assert not over_budget(0.0, 100.0, 0, 1.0)  # the first run always happens
    assert not over_budget(0.0, 25.0, 1, 1.0)  # 25 s done + 25 s more fits a minute
    assert over_budget(0.0, 35.0, 1, 1.0)  # 35 + 35 does not
    assert not over_budget(0.0, 1e6, 3, None)  # no budget: never stops
