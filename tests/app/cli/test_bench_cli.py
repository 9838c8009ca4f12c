"""localctx bench end to end on the fake backend (workers are real subprocesses, the model is fake):
the JSON's shape, the plots, re-rendering a saved run, and bad input."""
from __future__ import annotations

import json
import sys

import pytest

from localctx.backends.fake.session import FAKE_SPEC
from localctx.kvcache import cost
from localctx.kvcache.policy import KVPolicy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
POINT_FIELDS = {"context", "status", "runs", "prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s",
                "kv_bytes", "kv_bytes_projected", "kv_tokens", "evicted_tokens", "peak_rss_bytes",
                "roofline_decode_tok_s", "roofline_fraction", "planner_decode_tok_s", "decode_vs_baseline",
                "samples"}


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """One small bench run shared by the tests below (4096 is the fake model's trained context)."""
    from localctx.app.cli import main

    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--backend", "fake", "--kv", "fp16,int4,int8+sink4+win64", "--contexts", "128,512,8k",
                 "--runs", "2", "--gen-tokens", "8", "--out", str(out)])
    return code, out, json.loads((out / "bench.json").read_text())


def test_run_writes_json_and_png_plots(fake_run):
    code, out, result = fake_run
    assert code == 0
    assert result["schema"] == "localctx.bench/2"
    assert result["plots"] == ["bench-decode.png", "bench-kv.png", "bench-prefill.png"]
    for name in result["plots"]:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000  # a real image, not an empty file


def test_json_shape(fake_run):
    _, _, result = fake_run
    assert set(result) >= {"command", "machine", "model", "settings", "baseline", "projection", "series",
                           "headline", "quant_vs_fp16", "goals", "plots", "duration_s"}
    assert result["settings"]["contexts"] == [128, 512, 8192] and result["settings"]["runs"] == 2
    assert result["command"].startswith("localctx bench --backend fake --kv fp16,int4,int8+sink4+win64")
    assert result["machine"]["logical_cores"] >= 1 and result["projection"]["bandwidth"]["bytes_s"] > 0
    by_key = {e["key"]: e for e in result["series"]}
    assert set(by_key) == {"fake/fp16", "fake/int4", "fake/int8+sink4+win64", "llama-cpp-python"}
    # the fake model is not a GGUF: the baseline is refused with a reason, not silently dropped
    assert by_key["llama-cpp-python"]["status"] == "refused" and "GGUF" in by_key["llama-cpp-python"]["reason"]
    for key in ("fake/fp16", "fake/int4"):
        statuses = [p["status"] for p in by_key[key]["points"]]
        assert statuses == ["ok", "ok", "n/a"]  # 8k is past the fake model's 4096: windowed policies only
    windowed = by_key["fake/int8+sink4+win64"]["points"]
    assert [p["status"] for p in windowed] == ["ok", "ok", "ok"]
    for entry in by_key.values():
        for p in entry["points"]:
            if p["status"] != "ok":
                continue
            assert set(p) >= POINT_FIELDS and p["runs"] == 2 and len(p["samples"]) == 2
            assert p["decode_tok_s"]["min"] <= p["decode_tok_s"]["median"] <= p["decode_tok_s"]["max"]
            assert p["prompt_tokens"] <= p["context"] - 8
            assert p["planner_decode_tok_s"] > 0 and p["roofline_decode_tok_s"] > 0


def test_kv_bytes_match_the_cost_model(fake_run):
    _, _, result = fake_run
    for entry in result["series"]:
        if entry["baseline"]:
            continue
        policy = KVPolicy.parse(entry["policy"])
        for p in (p for p in entry["points"] if p["status"] == "ok"):
            stream = p["kv_tokens"] + p["evicted_tokens"]
            assert p["kv_bytes"] == p["kv_bytes_projected"] == cost.kv_bytes(FAKE_SPEC, policy, stream)
    windowed = next(e for e in result["series"] if e["policy"] == "int8+sink4+win64")
    far = windowed["points"][-1]
    assert far["kv_tokens"] == 4 + 64 and far["evicted_tokens"] > 8000  # the stream went past n_ctx


def test_headline_and_goals_are_reported(fake_run):
    _, _, result = fake_run
    head = result["headline"]
    assert (head["short"], head["long"], head["far"]) == (128, 512, 8192)
    rows = {r["series"]: r for r in head["rows"]}
    assert rows["fake/fp16"]["ratio"] > 0 and rows["fake/fp16"]["ratio_far"] is None
    assert rows["fake/int8+sink4+win64"]["ratio_far"] > 0
    window, torch_quant, planner, planner_speed = result["goals"]
    assert window["status"] in ("holds", "fails") and "fake/int8+sink4+win64" in window["detail"]
    assert torch_quant["status"] == "not measured"  # no torch series in this run
    # the planner is asked for each backend at each context within the trained length; fp16 fits a fake model
    picks = result["projection"]["planner_picks"]
    assert [(p["backend"], p["context"], p["fp16_fits"]) for p in picks] == [("fake", 128, True), ("fake", 512, True)]
    assert all(p["policy"] == "fp16" for p in picks)
    # and where fp16 is ruled out: a memory cap it does not fit under, a speed target above its projection
    forced = result["projection"]["forced_picks"]
    assert [(p["context"], p["forced"]) for p in forced] == [(128, "memory"), (128, "speed"), (512, "memory"),
                                                             (512, "speed")]
    for pick in (p for p in forced if p["forced"] == "memory"):
        assert "fp16" not in pick["fitting"] and "int4" in pick["fitting"] and pick["policy"] == "int8"
    # the planner's int8 is not among this run's --kv, so the goal cannot judge it: it says so
    assert planner["status"] == "not measured", planner["detail"]
    assert "fake 128 memory → int8 (not benched)" in planner["detail"]
    assert planner_speed["status"] == "holds" and "fake 128 speed → refused" in planner_speed["detail"]


def test_from_json_redraws_without_measuring(fake_run, cli, tmp_path):
    _, out, result = fake_run
    doc = tmp_path / "docs" / "benchmarks-bench.md"
    r = cli("bench", "--from-json", str(out / "bench.json"), "--out", str(tmp_path), "--doc", str(doc),
            "--note", "a note for the page")
    assert r.code == 0
    page = doc.read_text()
    assert "> a note for the page" in page and "![bench-decode.png](img/bench-decode.png)" in page
    assert result["command"] in page and "| localctx fake int8+sink4+win64 | 8k |" in page
    assert (doc.parent / "img" / "bench-decode.png").read_bytes()[:8] == PNG_MAGIC
    saved = doc.parent / "results" / "bench" / "bench.json"  # where docs/ keeps raw results, not among the images
    assert json.loads(saved.read_text())["note"] == "a note for the page"
    assert not (doc.parent / "img" / "bench.json").exists()
    assert f"localctx bench --from-json {saved.as_posix()} --out /tmp/bench-redraw --doc {doc.as_posix()}" in page
    assert "fake/int8+sink4+win64" in r.out or "fake int8+sink4+win64" in r.out
    assert (tmp_path / "bench-kv.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((tmp_path / "bench.json").read_text())["series"] == result["series"]


@pytest.mark.parametrize("args, message", [
    (["--runs", "0"], "--runs"),
    (["--contexts", "12k,abc"], "--contexts"),
    (["--kv", "int3"], "int3"),
    (["--backend", "nope"], "unknown backend"),
    (["--kv", "fp16", "--contexts", "64", "--gen-tokens", "64"], "gen-tokens"),
])
def test_bad_input_is_one_line_and_exit_2(cli, tmp_path, args, message):
    r = cli("bench", "--backend", "fake", "--out", str(tmp_path), *args) if "--backend" not in args else \
        cli("bench", "--out", str(tmp_path), *args)
    assert r.code == 2
    assert message in r.err and r.err.count("\n") == 1 and "Traceback" not in r.err


def test_from_json_rejects_a_file_that_is_not_a_bench_result(cli, tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    r = cli("bench", "--from-json", str(bad), "--out", str(tmp_path))
    assert r.code == 2 and "not a localctx bench result" in r.err
    bad.write_text('{"schema": "localctx.bench/1"}')
    r = cli("bench", "--from-json", str(bad), "--out", str(tmp_path))
    assert r.code == 2 and "another version" in r.err


def test_from_json_with_a_truncated_result_is_a_one_line_error(fake_run, cli, tmp_path):
    _, out, result = fake_run
    del result["projection"]
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(result))
    r = cli("bench", "--from-json", str(cut), "--out", str(tmp_path / "o"))
    assert r.code == 2 and "missing 'projection'" in r.err and "Traceback" not in r.err


def test_max_minutes_keeps_whole_runs_and_says_so(cli, tmp_path):
    r = cli("bench", "--backend", "fake", "--kv", "fp16", "--contexts", "128,256", "--runs", "3", "--gen-tokens", "8",
            "--max-minutes", "0.00001", "--out", str(tmp_path), "--no-plots")
    assert r.code == 0 and "stopped after 1 of 3 runs" in r.out
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["settings"]["runs"], result["settings"]["runs_asked"]) == (1, 3)
    assert all(p["runs"] == 1 for e in result["series"] for p in e["points"] if p["status"] == "ok")
    assert "--max-minutes 1e-05" in result["command"]


def test_without_matplotlib_the_json_is_kept_and_the_fix_is_named(fake_run, cli, tmp_path, monkeypatch):
    _, out, _ = fake_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    r = cli("bench", "--from-json", str(out / "bench.json"), "--out", str(tmp_path))
    assert r.code == 2 and "pip install 'localctx[bench]'" in r.err
    assert json.loads((tmp_path / "bench.json").read_text())["plots"] == []
