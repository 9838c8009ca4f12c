"""The openai backend against real servers on 127.0.0.1: localctx serve (the plan and --kv pass
through) and llama-cpp-python's own server (the KV policy is the server's); and summarize over
two localctx serve endpoints with one killed mid-job (every document exactly once)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from localctx.app.cli import main as cli_main
from localctx.backends.base import GenerationParams
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.backends.openai.session import RemoteRequest, open_remote
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.app.serve.protocol import RequestRules
from localctx.app.serve.scheduler import Limits
from serve_helpers import serve_in_thread, serve_subprocess

QUESTION = [{"role": "user", "content": "where do the sinks keep tokens"}]


@pytest.fixture(scope="module")
def localctx_server():
    session = FakeBackend(0.0).load(None, Plan.fixed("fake", FAKE_SPEC, KVPolicy.parse("int8+sink4+win512"), 2048))
    with serve_in_thread(session, "fake", limits=Limits(kv_lanes_per_min=60), rules=RequestRules(ignore_eos=True)) \
            as (url, _):  # an operator who allows per-request KV lanes and ignore_eos (both off by default)
        yield url


def test_against_localctx_serve_the_plan_and_kv_policy_pass_through(localctx_server):
    session = open_remote(RemoteRequest(endpoints=(localctx_server,)))
    assert session.is_localctx and str(session.plan.policy) == "int8+sink4+win512" and not session.plan.exact
    assert session.plan.context == 2048 and session.spec.context_length == FAKE_SPEC.context_length
    assert session.decode_threads == 0  # the server decodes: the chat's frames take nothing from it
    assert session.count_tokens(QUESTION) == FakeBackend(0.0).load(None, session.plan).count_tokens(QUESTION)
    events = list(session.generate(QUESTION, GenerationParams(max_tokens=5)))
    assert "".join(e.text for e in events) == "Reply: where do the sinks "
    done = events[-1]
    assert done.kind == "done" and done.finish_reason == "length" and done.stats.generated_tokens == 5
    assert done.stats.kv_bytes > 0 and done.stats.policy == "int8+sink4+win512"
    plain = list(session.generate(QUESTION, GenerationParams(max_tokens=60)))[-1]
    assert plain.finish_reason == "stop" and plain.stats.generated_tokens < 60  # the fake ends with EOS
    full = list(session.generate(QUESTION, GenerationParams(max_tokens=60, ignore_eos=True)))[-1]
    assert full.finish_reason == "length" and full.stats.generated_tokens == 60  # ignore_eos went through
    lane = open_remote(RemoteRequest(endpoints=(localctx_server,), kv="int4+sink4+win256"))  # a lane on the server
    assert str(lane.plan.policy) == "int4+sink4+win256" and "lane" in lane.plan.reasons[0]
    done = list(lane.generate(QUESTION, GenerationParams(max_tokens=3)))[-1]
    assert done.stats.policy == "int4+sink4+win256" and done.stats.generated_tokens == 3
    over = open_remote(RemoteRequest(endpoints=(localctx_server,), kv="fp16"))  # over the server's KV budget
    with pytest.raises(UserError, match="KV budget"):
        list(over.generate(QUESTION, GenerationParams(max_tokens=3)))
    with pytest.raises(UserError, match="does not serve"):
        open_remote(RemoteRequest(endpoints=(localctx_server,), model="other"))


def test_run_with_the_openai_backend(localctx_server, cli):
    result = cli("run", "--backend", "openai", "--endpoint", localctx_server, "--max-tokens", "4", "--json",
                 "where do the sinks keep tokens")
    out = json.loads(result.out)
    assert result.code == 0 and out["text"] == "Reply: where do the " and out["backend"] == "openai"
    assert out["policy"] == "int8+sink4+win512"


def test_an_unreachable_endpoint_is_a_one_line_error(cli):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    result = cli("run", "--backend", "openai", "--endpoint", f"http://127.0.0.1:{port}", "hi")
    assert result.code == 2 and "cannot reach the endpoint" in result.err and result.err.count("\n") == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_against_llama_cpp_python_server_the_kv_policy_is_the_servers(smollm2_path, cli):
    pytest.importorskip("llama_cpp.server.app", reason="pip install fastapi sse-starlette starlette-context "
                                                       "pydantic-settings (llama-cpp-python's server extras)")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_path), "--host",
                             "127.0.0.1", "--port", str(port), "--n_ctx", "1024"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "llama_cpp.server did not start"
                time.sleep(0.3)
        session = open_remote(RemoteRequest(endpoints=(url,), context=1024))
        assert not session.is_localctx and session.plan.context == 1024
        assert any("the KV policy is the server's" in r for r in session.plan.reasons)
        events = list(session.generate([{"role": "user", "content": "Name a colour."}],
                                       GenerationParams(max_tokens=8, temperature=0.0)))
        assert "".join(e.text for e in events).strip() and events[-1].finish_reason == "length"
        assert events[-1].stats.generated_tokens == 8  # counted from the stream (this server sends no usage there)
        batch = [(i, e) for i, e in session.generate_batch(
            [[{"role": "user", "content": "Name a colour."}], "The sky is"], GenerationParams(max_tokens=4))]
        done = {i: e for i, e in batch if e.kind == "done"}
        assert sorted(done) == [0, 1] and all(e.stats.prompt_tokens > 0 and e.stats.generated_tokens == 4
                                              for e in done.values())
        planned = cli("plan", "--backend", "openai", "--endpoint", url, "--json")
        assert planned.code == 0
        described = json.loads(planned.out)
        assert described["kv_policy"] == "the server's" and "kv" not in described["passes"]
        with pytest.raises(UserError, match="its KV policy is its own"):
            open_remote(RemoteRequest(endpoints=(url,), kv="int8"))
    finally:
        proc.terminate()
        proc.wait(10)


def health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5).read())


def test_summarize_over_two_endpoints_survives_one_killed_mid_job(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(10):
        (docs / f"doc{i:02d}.txt").write_text(f"Document {i} says the cache keeps token {i} near the sinks.\n")
    out = tmp_path / "out"
    env = {"LOCALCTX_FAKE_DELAY": "0.04"}
    with serve_subprocess(["--backend", "fake"], env) as (p1, url1), serve_subprocess(["--backend", "fake"], env) \
            as (p2, url2):
        result = {}
        args = ["summarize", str(docs), "--out", str(out), "--backend", "openai", "--endpoint", url1,
                "--endpoint", url2, "--summary-tokens", "16", "--json"]
        job = threading.Thread(target=lambda: result.setdefault("code", cli_main(args)))
        job.start()
        deadline = time.monotonic() + 60
        while not (health(url2)["served"] >= 1 and health(url2)["active"] >= 1):
            assert time.monotonic() < deadline and job.is_alive(), "endpoint 2 never got a second request"
            time.sleep(0.01)
        p2.kill()  # mid-job: its in-flight request must be sent to endpoint 1
        job.join(120)
        assert not job.is_alive() and result["code"] == 0
        report = json.loads((out / "summarize-report.json").read_text())
        # a rerun (endpoint 1 alone) finds every document done: nothing is summarised twice
        assert cli_main(["summarize", str(docs), "--out", str(out), "--backend", "openai", "--endpoint", url1,
                         "--summary-tokens", "16", "--json"]) == 0
        rerun = json.loads((out / "summarize-report.json").read_text())
    assert report["counts"]["done"] == 10 and report["totals"]["calls"] == 10
    assert sorted(r["path"] for r in report["documents"]) == [f"doc{i:02d}.txt" for i in range(10)]
    manifest = json.loads((out / ".localctx-summarize" / "manifest.json").read_text())
    assert sorted(manifest["documents"]) == [f"doc{i:02d}.txt" for i in range(10)]
    for i in range(10):
        # the fake model repeats the start of its prompt: each summary answers its own document
        assert (out / f"doc{i:02d}.txt.summary.md").read_text().startswith(f'Reply: Summarise the document "doc{i:02d}.txt"')
    assert rerun["counts"]["unchanged"] == 10 and rerun["totals"]["calls"] == 0


def test_plan_against_localctx_serve_shows_the_servers_plan_and_what_passes(localctx_server, cli):
    result = cli("plan", "--backend", "openai", "--endpoint", localctx_server, "--json")
    described = json.loads(result.out)
    assert result.code == 0 and described["server_is_localctx"] is True
    assert described["kv_policy"] == "int8+sink4+win512" and {"kv", "context"} <= set(described["passes"])
    assert described["plan"]["context"] == 2048
