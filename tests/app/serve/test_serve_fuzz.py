"""localctx serve over HTTP on 127.0.0.1 with real backends — torch (a tiny random-weight GGUF,
two slots) and llama.cpp (the bundled SmolLM2, two slots): the issue's requests (a seed of 2**64
twice at once, a NaN temperature) are refused with 400 and the server answers the next request
at once; a stream decoding beside failing requests (bad numbers, a prompt that cannot be
tokenized, a client that leaves mid-stream) finishes intact; a foreign Host and a text/plain body
are refused; a property-based fuzz of request bodies (hypothesis, bounded) gets no 5xx and loses
no slot; /metrics parses with prometheus-client's parser afterwards."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from localctx.app.serve.protocol import RequestRules
from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from serve_helpers import serve_in_thread
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
QUESTION = [{"role": "user", "content": "Name a colour."}]
RULES = RequestRules(max_tokens=6, ignore_eos=True)  # every answer short: the fuzz stays bounded


@pytest.fixture(scope="module", params=["torch", pytest.param("llamacpp", marks=pytest.mark.slow)])
def served(request, tmp_path_factory):
    """(base URL, scheduler, session, ServeState) of a two-slot server."""
    if request.param == "torch":
        cfg = TinyConfig()
        path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", cfg, tiny_weights(cfg, seed=11))
        loaded = load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)
        session = build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse("fp16"), 480), OPTIONS)
    else:
        session = open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=2048))
    states: list = []
    with serve_in_thread(session, "m", parallel=2, rules=RULES, on_state=states.append) as (url, scheduler):
        yield url, scheduler, session, states[0]
    session.close()


@dataclass
class Answer:
    status_code: int
    headers: dict
    text: str

    def json(self):
        return json.loads(self.text)


def connect(url: str, timeout: float = 60) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def post(url: str, payload, path: str = "/chat/completions", headers: dict | None = None,
         timeout: float = 60) -> Answer:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()  # NaN written as NaN
    conn = connect(url, timeout)
    try:
        conn.request("POST", urlsplit(url).path + path, body=data,
                     headers={"Content-Type": "application/json"} if headers is None else headers)
        r = conn.getresponse()
        return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace"))
    finally:
        conn.close()


def all_free(scheduler) -> bool:
    load = scheduler.load()
    slots = [slot for lane in scheduler.streams.lanes for slot in getattr(lane.streams, "slots", [])]
    return load["active"] == 0 and load["queued"] == 0 and not any(slot.busy for slot in slots)


def wait_free(scheduler, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not all_free(scheduler):
        assert time.monotonic() < deadline, f"slots still taken: {scheduler.load()}"
        time.sleep(0.02)


def test_the_issues_seed_and_nan_are_400_and_the_next_request_is_answered_at_once(served):
    url, scheduler, _, _ = served
    big_seed = {"messages": QUESTION, "max_tokens": 3, "temperature": 1, "seed": 2 ** 64}
    answers: list = []
    threads = [threading.Thread(target=lambda: answers.append(post(url, big_seed))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [a.status_code for a in answers] == [400, 400] and answers[0].json()["error"]["param"] == "seed"
    nan = post(url, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": NaN}')
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
    started = time.monotonic()
    ok = post(url, {"messages": QUESTION, "max_tokens": 3, "temperature": 0.8, "seed": 2 ** 63 - 1}, timeout=20)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert time.monotonic() - started < 15  # not a queue timeout: no slot was lost
    wait_free(scheduler)


def test_a_foreign_host_and_a_text_body_are_refused(served):
    url, _, _, _ = served
    port = urlsplit(url).port
    body = {"messages": QUESTION, "max_tokens": 2}
    assert post(url, body, headers={"Content-Type": "text/plain", "Host": "evil.example",
                                    "Origin": "http://evil.example"}).status_code == 403
    assert post(url, body, headers={"Content-Type": "text/plain"}).status_code == 415
    assert post(url, body, headers={"Content-Type": "application/json", "Host": f"localhost:{port}"}).status_code == 200


def test_a_neighbour_finishes_intact_beside_requests_that_fail(served, monkeypatch):
    url, scheduler, session, state = served
    monkeypatch.setattr(state, "rules", RequestRules(max_tokens=400, ignore_eos=True))
    long = {"messages": QUESTION, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    reference = post(url, long).json()["choices"][0]["message"]["content"]
    real_tokenize = scheduler.tokenize
    monkeypatch.setattr(scheduler, "tokenize", lambda p: (_ for _ in ()).throw(RuntimeError("untokenizable"))
                        if p == [{"role": "user", "content": "poison"}] else real_tokenize(p))
    text, outcomes, finish = [], {}, None
    conn = connect(url)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**long, "stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    neighbour = conn.getresponse()
    lines = (raw.decode().strip() for raw in iter(neighbour.readline, b""))
    try:
        for line in lines:  # the neighbour has started
            if line.startswith("data: {") and '"content"' in line:
                text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
                break
        outcomes["seed"] = post(url, {**long, "seed": 2 ** 64}).status_code
        outcomes["nan"] = post(url, json.dumps({**long, "top_p": float("nan")}).encode()).status_code
        outcomes["tokenize"] = post(url, {**long, "messages": [{"role": "user", "content": "poison"}]}).status_code
        leaving = socket.create_connection(("127.0.0.1", urlsplit(url).port))
        data = json.dumps({**long, "stream": True}).encode()
        leaving.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        leaving.recv(64)  # its answer has begun
        assert scheduler.load()["active"] == 2  # beside the neighbour, still decoding
        leaving.close()  # and its client is gone
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
                    finish = chunk["choices"][0].get("finish_reason") or finish
    finally:
        conn.close()
    assert outcomes == {"seed": 400, "nan": 400, "tokenize": 500}
    assert finish == "length"  # all its max_tokens, to the end (ignore_eos)
    if session.backend_name == "torch":
        assert "".join(text) == reference  # the neighbour's greedy answer, whole
    else:
        # llama.cpp rounds a step of two sequences otherwise than a step of one on some CPUs (seen on an
        # AVX-512 host), so past the point where the other stream joined the greedy text may part from
        # the answer it gives alone; up to there it is that answer
        assert reference.startswith(text[0])
    wait_free(scheduler)


NUMBERS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.integers(-3, 9),
                    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2), st.text(max_size=4))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(), st.text(max_size=12))
JSONISH = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                                                         max_size=3), max_leaves=6)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
                                 "content": st.one_of(st.text(max_size=30), JSONISH,
                                                      st.lists(st.fixed_dictionaries(
                                                          {"type": st.sampled_from(["text", "image_url"]),
                                                           "text": st.text(max_size=10)}), max_size=2))})
BODY = st.fixed_dictionaries({}, optional={
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSONISH), "prompt": st.one_of(st.text(max_size=30), JSONISH),
    "model": st.sampled_from(["m", "other", None]), "max_tokens": NUMBERS, "max_completion_tokens": NUMBERS,
    "temperature": NUMBERS, "top_p": NUMBERS, "top_k": NUMBERS, "seed": NUMBERS, "n": NUMBERS,
    "presence_penalty": NUMBERS, "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5),
                                                   JSONISH),
    "stream": st.one_of(st.booleans(), SCALARS), "stream_options": st.one_of(JSONISH, st.just({"include_usage": True})),
    "ignore_eos": st.one_of(st.booleans(), SCALARS), "unknown": JSONISH,
    "localctx": st.one_of(JSONISH, st.fixed_dictionaries({}, optional={
        "kv": st.one_of(st.sampled_from(["fp16", "int8", "int4+res128", "fp16+sink4+win64", "q9", ""]), JSONISH),
        "context": st.one_of(st.integers(-5, 5000), JSONISH)}))})


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(BODY, st.binary(max_size=40)), chat=st.booleans())
def test_fuzzed_bodies_get_no_5xx_and_lose_no_slot(served, body, chat):
    url, scheduler, _, _ = served
    path = "/chat/completions" if chat else "/completions"
    answer = post(url, body, path)
    assert answer.status_code < 500, answer.text
    if answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream"):
        assert '"server_error"' not in answer.text
    wait_free(scheduler, 5)


def test_metrics_parse_after_the_fuzz(served):
    url, scheduler, _, _ = served
    conn = connect(url)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    got = {f.name: f for f in text_string_to_metric_families(text)}
    statuses = {s.labels["status"] for s in got["localctx_requests"].samples if s.name == "localctx_requests_total"}
    assert {"200", "400"} <= statuses
    assert got["localctx_slots"].samples[0].value == 2 and got["localctx_slots_busy"].samples[0].value == 0
    assert got["localctx_generated_tokens"].samples[0].value > 0
