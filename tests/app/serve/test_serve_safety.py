"""localctx serve safe on a desktop, on the fake backend over HTTP on 127.0.0.1: every number
range-checked and finite (400 naming the field), malformed and deep JSON refused (400), the host,
origin and media-type rule without a key, CORS only for --cors origins, the --max-tokens cap said
in the answer, ignore_eos off unless allowed, /metrics in Prometheus' format, and a client that
leaves at any point frees its slot. The same on llama.cpp and torch: tests/app/serve/test_serve_isolation.py
and test_serve_fuzz.py."""
from __future__ import annotations

import http.client
import json
import socket
import time
from urllib.parse import urlsplit

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from localctx.app.serve.access import Access
from localctx.app.serve.protocol import RequestRules
from localctx.app.serve.scheduler import Limits
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from serve_helpers import serve_in_thread

QUESTION = [{"role": "user", "content": "where do the sinks keep tokens"}]
JSON = {"Content-Type": "application/json"}


def fake_session(delay: float = 0.0):
    return FakeBackend(delay).load(None, Plan.fixed("fake", FAKE_SPEC, KVPolicy.parse("fp16"), 4096))


def post(url: str, body: bytes | dict, headers: dict | None = None, path: str = "/chat/completions",
         method: str = "POST") -> tuple[int, dict, dict]:
    """(status, JSON body or {}, headers) of one request over a raw connection (any Host header)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        conn.request(method, parts.path + path, body=data if method == "POST" else None,
                     headers=JSON if headers is None else headers)
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw and raw[:1] in b"{[" else {}, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server():
    with serve_in_thread(fake_session(), "fake") as (url, scheduler):
        yield url, scheduler


def body(**fields) -> dict:
    return {"messages": QUESTION, "max_tokens": 3, **fields}


BAD_NUMBERS = [("seed", 2 ** 64), ("seed", -2 ** 63 - 1), ("seed", 1.5), ("temperature", float("nan")),
               ("temperature", float("inf")), ("temperature", -0.1), ("temperature", 2.5), ("temperature", "1"),
               ("temperature", True), ("top_p", 1.5), ("top_p", float("-inf")), ("top_k", -1), ("top_k", 2 ** 31),
               ("top_k", 2.0), ("max_tokens", 0), ("max_tokens", 2 ** 40), ("max_completion_tokens", -3),
               ("n", 2), ("presence_penalty", 3), ("frequency_penalty", float("nan"))]


@pytest.mark.parametrize("field,value", BAD_NUMBERS)
def test_every_number_is_range_checked_and_finite_with_the_field_named(server, field, value):
    url, scheduler = server
    raw = json.dumps(body(**{field: value})).encode()  # Python writes NaN and Infinity, as a careless client would
    status, err, _ = post(url, raw)
    assert status == 400 and err["error"]["param"] == field and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"]
    assert scheduler.load()["active"] == 0 and scheduler.load()["queued"] == 0


def test_the_edges_of_every_range_are_served(server):
    url, _ = server
    for fields in ({"seed": 2 ** 63 - 1, "temperature": 2}, {"seed": -2 ** 63, "temperature": 0.5},
                   {"top_p": 0, "top_k": 2 ** 31 - 1}, {"n": 1, "presence_penalty": -2, "frequency_penalty": 2}):
        status, answer, _ = post(url, body(**fields))
        assert status == 200 and answer["usage"]["completion_tokens"] == 3, fields


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"messages": ' + b"[" * 65 + b"]" * 65 + b"}", b"{not json",
                                 b"\xff\xfe{}", b"", b"[1, 2]", b'{"messages": "hi"}', b'{"stream": "yes"}'])
def test_malformed_or_deep_json_is_400_in_openais_shape(server, raw):
    url, scheduler = server
    status, err, _ = post(url, raw)
    assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}
    assert post(url, body())[0] == 200  # and the server answers the next request


def test_without_a_key_only_this_machines_names_json_bodies_and_its_own_pages_are_answered(server):
    url, _ = server
    port = urlsplit(url).port
    ok = body()
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "127.0.0.2", "app.localhost"):
        status, _, headers = post(url, ok, {**JSON, "Host": host})
        assert status == 200 and "access-control-allow-origin" not in headers, host
    # the request: a web page's text/plain POST, addressed by DNS rebinding to another name
    status, err, _ = post(url, ok, {"Content-Type": "text/plain", "Host": "evil.example",
                                    "Origin": "http://evil.example"})
    assert status == 403 and err["error"]["code"] == "host_not_allowed" and "--allow-host" in err["error"]["message"]
    status, err, _ = post(url, ok, {"Host": "evil.example"}, path="/models", method="GET")
    assert status == 403  # reading is refused too: a rebound page cannot see the plan or the lanes
    status, err, _ = post(url, ok, {"Content-Type": "text/plain"})
    assert status == 415 and err["error"]["code"] == "unsupported_media_type"
    for media in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        assert post(url, ok, {"Content-Type": media} if media else {})[0] == 415, media
    assert post(url, ok, {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    status, err, _ = post(url, ok, {**JSON, "Origin": "http://evil.example"})
    assert status == 403 and err["error"]["code"] == "origin_not_allowed" and "--cors" in err["error"]["message"]
    status, _, headers = post(url, ok, {**JSON, "Origin": f"http://localhost:{port}"})
    assert status == 200 and "access-control-allow-origin" not in headers  # same machine; still no CORS header
    assert post(url, b"", {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
                method="OPTIONS")[0] == 403


def test_allow_host_cors_origins_and_a_key_each_open_only_what_they_name():
    access = Access(allowed_hosts=("box.lan",), cors_origins=("http://app.example",))
    with serve_in_thread(fake_session(), "fake", access=access) as (url, _):
        assert post(url, body(), {**JSON, "Host": "box.lan:8080"})[0] == 200
        assert post(url, body(), {**JSON, "Host": "other.lan"})[0] == 403
        status, _, headers = post(url, body(), {**JSON, "Origin": "http://app.example"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
        status, _, headers = post(url, b"", {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                                             "Access-Control-Request-Headers": "content-type"}, method="OPTIONS")
        assert status == 204 and "POST" in headers["access-control-allow-methods"]
        assert "Content-Type" in headers["access-control-allow-headers"]
        status, _, headers = post(url, body(), {**JSON, "Origin": "http://evil.example"})
        assert status == 403 and "access-control-allow-origin" not in headers
    with serve_in_thread(fake_session(), "fake", api_key="s3cret") as (url, _):
        auth = {**JSON, "Authorization": "Bearer s3cret", "Host": "anything.example"}
        assert post(url, body(), auth)[0] == 200  # with a key, the key decides
        assert post(url, body(), {**JSON, "Host": "localhost"})[0] == 401
        root = url.removesuffix("/v1")
        assert post(root, b"", {"Host": "anything.example"}, path="/health", method="GET")[0] == 200  # no key needed
        assert post(root, b"", {}, path="/metrics", method="GET")[0] == 401
        assert post(root, b"", {"Authorization": "Bearer s3cret"}, path="/metrics", method="GET")[0] == 200


def test_the_servers_max_tokens_caps_an_answer_and_says_so():
    with serve_in_thread(fake_session(), "fake", rules=RequestRules(max_tokens=5, ignore_eos=True)) as (url, _):
        status, answer, _ = post(url, body(max_tokens=50, ignore_eos=True))
        ext = answer["localctx"]
        assert status == 200 and answer["usage"]["completion_tokens"] == 5
        assert answer["choices"][0]["finish_reason"] == "length"
        assert ext["max_tokens"] == 5 and ext["max_tokens_requested"] == 50
        status, answer, _ = post(url, {"messages": QUESTION, "ignore_eos": True})  # no max_tokens: the cap
        assert answer["usage"]["completion_tokens"] == 5 and "max_tokens_requested" not in answer["localctx"]
        status, answer, _ = post(url, body(max_tokens=3))
        assert answer["usage"]["completion_tokens"] == 3 and "max_tokens_requested" not in answer["localctx"]
        models = openai.OpenAI(base_url=url, api_key="none").models.list().data[0].model_extra["localctx"]
        assert models["max_tokens"] == 5 and models["ignore_eos"] is True and models["kv_lanes_per_min"] == 0


def test_ignore_eos_is_off_unless_the_operator_allows_it(server):
    url, _ = server
    status, err, _ = post(url, body(ignore_eos=True))
    assert status == 400 and err["error"]["code"] == "ignore_eos_off" and "--allow-ignore-eos" in err["error"]["message"]
    assert post(url, body(ignore_eos=False))[0] == 200


def families(url: str, headers: dict | None = None) -> dict:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/metrics", headers=headers or {})  # at the root, beside /health
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == 200 and r.getheader("content-type").startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_parse_with_prometheus_clients_parser_and_count_what_was_served():
    with serve_in_thread(fake_session(), "fake", limits=Limits(max_queue=7)) as (url, scheduler):
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        done = [c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=n, temperature=0) for n in (3, 5)]
        streamed = list(c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True}))
        post(url, body(temperature=9))
        got = families(url)
    requests = {(s.labels["path"], s.labels["status"]): s.value for s in got["localctx_requests"].samples
                if s.name == "localctx_requests_total"}
    assert requests[("/v1/chat/completions", "200")] == 3 and requests[("/v1/chat/completions", "400")] == 1
    generated = sum(r.usage.completion_tokens for r in done) + streamed[-1].usage.completion_tokens
    value = {f: got[f].samples[0].value for f in ("localctx_generated_tokens", "localctx_prompt_tokens",
                                                  "localctx_slots", "localctx_queue_depth", "localctx_slots_busy",
                                                  "localctx_kv_budget_bytes", "localctx_kv_bytes")}
    assert value["localctx_generated_tokens"] == generated
    assert value["localctx_prompt_tokens"] == 3 * done[0].usage.prompt_tokens
    assert (value["localctx_slots"], value["localctx_queue_depth"], value["localctx_slots_busy"]) == (1, 0, 0)
    assert value["localctx_kv_budget_bytes"] == scheduler.streams.budget and value["localctx_kv_bytes"] == 0
    ttft = {s.name: s.value for s in got["localctx_time_to_first_token_seconds"].samples}
    assert ttft["localctx_time_to_first_token_seconds_count"] == 3
    speed = {s.name: s.value for s in got["localctx_decode_tokens_per_second"].samples}
    assert speed["localctx_decode_tokens_per_second_count"] == 3


def wait_until(check, seconds: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, what
        time.sleep(0.02)
    return time.monotonic() - started


def raw_request(url: str, payload: dict) -> socket.socket:
    """Sends a chat request on a socket of its own and returns it unread (the caller closes it)."""
    parts = urlsplit(url)
    data = json.dumps(payload).encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_at_any_point_ends_its_generation_and_frees_its_slot(stream):
    with serve_in_thread(fake_session(delay=0.05), "fake", rules=RequestRules(ignore_eos=True)) as (url, scheduler):
        long = {"messages": QUESTION, "max_tokens": 400, "stream": stream, "ignore_eos": True}
        # before the first byte: waiting in the queue behind a busy slot
        busy = raw_request(url, long)
        wait_until(lambda: scheduler.load()["active"] == 1, 10, "the first request never started")
        waiting = raw_request(url, long)
        wait_until(lambda: scheduler.load()["queued"] == 1, 10, "the second request never queued")
        waiting.close()
        wait_until(lambda: scheduler.load()["queued"] == 0, 3, "a client that left still waits in the queue")
        # mid-answer, tokens flowing (a whole answer sends nothing until its end: 400 tokens take 20 s)
        time.sleep(0.5)
        busy.close()
        wait_until(lambda: scheduler.load()["active"] == 0, 3, "the generation went on after its client left")
        assert scheduler.served == 1  # the one that ran, cancelled; the one that left the queue never started
        status, answer, _ = post(url, body())
        assert status == 200 and answer["usage"]["completion_tokens"] == 3


def test_cors_for_any_origin_needs_a_key_and_flags_are_checked_before_loading(capsys):
    from localctx.app import cli

    assert cli.main(["serve", "--backend", "fake", "--cors", "*"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--cors" in err and "API key" in err
    for flag, value in (("--max-tokens", "0"), ("--kv-lanes", "-1")):
        assert cli.main(["serve", "--backend", "fake", flag, value]) == 2
        assert flag in capsys.readouterr().err
