"""Map-reduce and refine over the fake backend, batching, and resuming after failures."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localctx.app.summarize.jobs import Settings, make_job, plan_budget
from localctx.app.summarize.inputs import Document
from localctx.app.summarize.prompts import load_prompts
from localctx.app.summarize.store import TMP_PREFIX
from localctx.backends.fake.session import FakeSession
from localctx.kvcache.errors import RuntimeFailure, UserError
from summarize_helpers import fake_session, outputs, run, topics_text, write_corpus


def drive(job):
    """Runs a job to the end with the fake session, one request at a time; returns all requests."""
    session = fake_session(job.budget.context)
    seen = []
    while not job.done:
        request = job.queue.pop(0)
        seen.append(request)
        text = "".join(e.text for _i, e in session.generate_batch([request.messages]))
        job.deliver(request, text, "stop")
    return seen


def test_map_reduce_covers_every_chunk_and_recurses_on_long_input():
    session = fake_session(600)
    text = topics_text(0, 60)
    job = make_job(Document("long.txt", Path("long.txt"), text, "x"), Settings(summary_tokens=64),
                   load_prompts(), session.count_tokens, 600)
    requests = drive(job)
    maps = [r for r in requests if r.step == "map"]
    assert len(maps) == len(job.chunks) > 20
    # the document reaches the model whole: each chunk text sits in its own map prompt, in order
    assert "".join(job.text(c) for c in job.chunks) == text
    for r, c in zip(maps, job.chunks):
        assert job.text(c) in r.messages[-1]["content"]
        assert session.count_tokens(r.messages) + 64 <= 600
    reduces = [r for r in requests if r.step == "reduce"]
    assert job.depth >= 2 and max(r.level for r in reduces) == job.depth
    assert sum(1 for r in reduces if r.level == job.depth) == 1  # the last level is one call
    assert job.result and job.calls == len(requests)


def test_refine_runs_chunks_in_order_carrying_the_summary():
    session = fake_session(800)
    text = topics_text(10, 8)
    job = make_job(Document("d.md", Path("d.md"), text, "x"), Settings(mode="refine", summary_tokens=64),
                   load_prompts(), session.count_tokens, 800)
    requests = drive(job)
    assert len(requests) == len(job.chunks) > 2
    assert [r.step for r in requests] == ["map"] + ["refine"] * (len(requests) - 1)
    for r in requests:
        assert session.count_tokens(r.messages) + 64 <= 800


def test_budget_refuses_a_context_too_small():
    with pytest.raises(UserError, match="too small"):
        plan_budget(200, Settings(summary_tokens=128), lambda step: 40)
    with pytest.raises(UserError, match="--chunk-tokens"):
        plan_budget(1024, Settings(summary_tokens=64, chunk_tokens=5000), lambda step: 40)


def test_batches_mix_documents_within_the_context_budget(tmp_path):
    for i in range(6):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"d{i}.txt").write_text(f"Document {i} is short. " * 5)
    report, events = run([tmp_path / "in"], tmp_path / "out", max_batch=4)
    assert report["exit_code"] == 0 and report["counts"]["done"] == 6
    assert report["totals"]["widest_batch"] == 4 and report["totals"]["batches"] == 2
    report, _ = run([tmp_path / "in"], tmp_path / "out2", session=fake_session(300), max_batch=8)
    # 300 tokens hold one request of ~40 prompt + 48 answer tokens... three at a time
    assert report["totals"]["widest_batch"] == 3


def test_rerun_skips_finished_and_redoes_changed(tmp_path):
    files = write_corpus(tmp_path / "in")
    first, _ = run([tmp_path / "in"], tmp_path / "out")
    assert first["counts"]["done"] == len(files) and first["exit_code"] == 0
    long_rec = next(d for d in first["documents"] if d["path"] == "long.txt")
    assert long_rec["depth"] >= 1 and long_rec["chunks"] > 1
    before = outputs(tmp_path / "out")
    assert set(before) == {k + ".summary.md" for k in files}
    (tmp_path / "in" / "sub" / "short.rst").write_text("Short\n=====\n\nNow about sinks.\n")
    second, events = run([tmp_path / "in"], tmp_path / "out")
    status = {d["path"]: d["status"] for d in second["documents"]}
    assert status == {"long.txt": "unchanged", "sub/medium.md": "unchanged", "sub/short.rst": "done"}
    assert second["totals"]["calls"] == 1
    assert outputs(tmp_path / "out")["sub/short.rst.summary.md"] != before["sub/short.rst.summary.md"]
    third, _ = run([tmp_path / "in"], tmp_path / "out", summary_tokens=40)  # new settings: redo
    assert third["counts"]["done"] == 3


class FailingSession(FakeSession):
    """Raises after ``budget`` completed generations, like a backend dying mid-run."""

    def __init__(self, base, budget):
        super().__init__(base.plan, 0)
        self.budget = budget

    def generate_batch(self, prompts, params, cancel=None):
        for index, event in super().generate_batch(prompts, params, cancel):
            if event.kind == "done":
                if self.budget == 0:
                    raise RuntimeFailure("injected failure")
                self.budget -= 1
            yield index, event


def test_resume_after_injected_failure_matches_an_uninterrupted_run(tmp_path):
    write_corpus(tmp_path / "in")
    reference, _ = run([tmp_path / "in"], tmp_path / "ref")
    with pytest.raises(RuntimeFailure):
        run([tmp_path / "in"], tmp_path / "out", session=FailingSession(fake_session(), 7))
    crashed = json.loads((tmp_path / "out" / "summarize-report.json").read_text())
    assert crashed["counts"]["interrupted"] >= 1
    resumed, _ = run([tmp_path / "in"], tmp_path / "out")
    assert resumed["totals"]["cached_calls"] == 7  # the 7 finished generations were not redone
    assert resumed["totals"]["calls"] == reference["totals"]["calls"]
    assert outputs(tmp_path / "out") == outputs(tmp_path / "ref")


def _cli_env():
    import localctx.app
    root = os.path.dirname(os.path.dirname(os.path.dirname(localctx.app.__file__)))
    return {**os.environ, "PYTHONPATH": root, "LOCALCTX_FAKE_DELAY": "0.003"}


def test_resume_after_sigkill(tmp_path):
    write_corpus(tmp_path / "in")
    for i in range(4):
        (tmp_path / "in" / f"a_note{i}.txt").write_text(f"Note {i}. " + topics_text(60 + i, 1))
    cmd = [sys.executable, "-m", "localctx.app.cli", "summarize", str(tmp_path / "in"), "--out",
           str(tmp_path / "out"), "--backend", "fake", "--context", "1024", "--summary-tokens", "48", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_cli_env())
    done_before = set()
    deadline = time.time() + 60
    for line in proc.stdout:
        event = json.loads(line)
        if event["event"] == "document_done":
            done_before.add(event["path"])
            os.kill(proc.pid, signal.SIGKILL)
            break
        assert time.time() < deadline
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and done_before
    rerun = subprocess.run(cmd, capture_output=True, text=True, env={**_cli_env(), "LOCALCTX_FAKE_DELAY": "0"})
    assert rerun.returncode == 0, rerun.stderr
    final = json.loads(rerun.stdout.splitlines()[-1])
    report = json.loads((tmp_path / "out" / "summarize-report.json").read_text())
    status = {d["path"]: d["status"] for d in report["documents"]}
    assert all(status[p] == "unchanged" for p in done_before)
    assert set(status.values()) == {"unchanged", "done"} and final["counts"]["interrupted"] == 0
    assert not [p for p in (tmp_path / "out").rglob("*") if p.name.startswith(TMP_PREFIX)]
    run([tmp_path / "in"], tmp_path / "ref")  # the same settings, uninterrupted, in process
    assert outputs(tmp_path / "out") == outputs(tmp_path / "ref")
