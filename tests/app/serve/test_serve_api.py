"""localctx serve against the official openai client, on the fake backend (deterministic words,
optional per-token delay), served on 127.0.0.1 in a thread: whole and streamed answers, the
``localctx`` extension, every error status, and a disconnect that cancels its generation."""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from localctx.app import cli
from localctx.app.serve.protocol import RequestRules
from localctx.app.serve.scheduler import Limits
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from serve_helpers import serve_in_thread

QUESTION = [{"role": "user", "content": "where do the sinks keep tokens"}]


def fake_session(delay: float = 0.0, context: int = 4096):
    return FakeBackend(delay).load(None, Plan.fixed("fake", FAKE_SPEC, KVPolicy.parse("fp16"), context))


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def server():
    """A server whose operator allows per-request KV policies and ignore_eos (both off by default)."""
    with serve_in_thread(fake_session(), "fake", limits=Limits(kv_lanes_per_min=60),
                         rules=RequestRules(ignore_eos=True)) as (url, scheduler):
        yield url, scheduler


def test_whole_and_streamed_answers_agree_and_carry_usage_and_the_plan(server):
    url, _ = server
    c = client(url)
    whole = c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=6, temperature=0)
    assert whole.choices[0].message.content == "Reply: where do the sinks keep "
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6 and whole.usage.prompt_tokens == fake_session().count_tokens(QUESTION)
    ext = whole.model_extra["localctx"]
    assert ext["policy"] == "fp16" and ext["exact"] is True and ext["evicted_tokens"] == 0
    assert ext["kv_bytes"] == ext["kv_tokens"] * 2 * FAKE_SPEC.n_layers * FAKE_SPEC.n_kv_heads * FAKE_SPEC.head_dim * 2
    pieces, last = [], None
    for chunk in c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=6, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            last = chunk
        else:
            assert chunk.usage.completion_tokens == 6
    assert "".join(pieces) == whole.choices[0].message.content
    assert last.choices[0].finish_reason == "length" and last.model_extra["localctx"]["policy"] == "fp16"


def test_raw_completion_and_a_follow_up_turn_reuses_the_cached_prefix(server):
    url, _ = server
    c = client(url)
    raw = c.completions.create(model="fake", prompt="quantized keys save memory", max_tokens=3, temperature=0)
    assert raw.choices[0].text == "Reply: quantized keys "
    first = c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=4, temperature=0)
    follow = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "and the window"}]
    second = c.chat.completions.create(model="fake", messages=follow, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_models_lists_the_trained_context_and_the_plan(server):
    url, _ = server
    models = client(url).models.list().data
    assert [m.id for m in models] == ["fake"]
    ext = models[0].model_extra["localctx"]
    assert ext["trained_context"] == FAKE_SPEC.context_length and ext["plan"]["policy"] == "fp16"
    assert ext["plan"]["context"] == 4096


def test_the_extension_field_limits_the_context_and_names_the_policy(server):
    url, _ = server
    c = client(url)
    long_question = [{"role": "user", "content": "word " * 40}]
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="fake", messages=long_question, max_tokens=4,
                                  extra_body={"localctx": {"context": 20}})
    err = bad.value.body
    assert err["code"] == "context_length_exceeded" and "context holds 20" in err["message"]
    ok = c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=50, temperature=0,
                                   extra_body={"localctx": {"kv": "fp16", "context": 30}})
    assert ok.usage.prompt_tokens + ok.usage.completion_tokens <= 30
    assert ok.model_extra["localctx"]["context"] == 30
    other = c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=4,
                                      extra_body={"localctx": {"kv": "int8"}})  # a lane of its own (test_serve_lanes)
    assert other.model_extra["localctx"]["policy"] == "int8" and other.model_extra["localctx"]["exact"] is False
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="fake", messages=QUESTION, extra_body={"localctx": {"context": 10 ** 6}})
    assert bad.value.body["code"] == "context_unavailable"
    assert "4,096 tokens (the model's trained context is 4,096)" in bad.value.body["message"]


def test_ignore_eos_runs_every_answer_to_max_tokens(server):
    url, _ = server
    c = client(url)
    plain = c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=60, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 60
    full = c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=60, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 60
    assert full.choices[0].message.content.startswith(plain.choices[0].message.content)
    streamed = list(c.chat.completions.create(model="fake", messages=QUESTION, max_tokens=60, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert streamed[-1].usage.completion_tokens == 60
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="fake", messages=QUESTION, extra_body={"ignore_eos": "yes"})
    assert bad.value.body["param"] == "ignore_eos"


def test_a_prompt_over_the_context_is_400_with_the_numbers_never_truncated():
    with serve_in_thread(fake_session(context=64), "fake") as (url, _):
        with pytest.raises(openai.BadRequestError) as bad:
            client(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "w " * 100}])
    msg = bad.value.body["message"]
    assert bad.value.status_code == 400 and "context holds 64" in msg and "shorten the prompt" in msg


def test_an_unknown_model_is_404_and_a_bad_body_is_400(server):
    url, _ = server
    with pytest.raises(openai.NotFoundError) as missing:
        client(url).chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    req = urllib.request.Request(url + "/chat/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(req, timeout=10)
    assert bad.value.code == 400 and set(json.loads(bad.value.read())["error"]) == {"message", "type", "param", "code"}


def test_a_wrong_key_is_401_and_an_oversized_body_413():
    with serve_in_thread(fake_session(), "fake", api_key="s3cret", max_body=2048) as (url, _):
        with pytest.raises(openai.AuthenticationError) as denied:
            client(url, "wrong").chat.completions.create(model="fake", messages=QUESTION)
        assert denied.value.status_code == 401 and denied.value.body["type"] == "authentication_error"
        ok = client(url, "s3cret").chat.completions.create(model="fake", messages=QUESTION, max_tokens=2)
        assert ok.choices[0].message.content
        with pytest.raises(openai.APIStatusError) as big:
            client(url, "s3cret").chat.completions.create(model="fake",
                                                          messages=[{"role": "user", "content": "x" * 5000}])
        assert big.value.status_code == 413 and big.value.body["code"] == "request_too_large"


def test_a_full_queue_is_503_with_retry_after():
    with serve_in_thread(fake_session(delay=0.05), "fake", limits=Limits(max_queue=1)) as (url, scheduler):
        def long_stream():  # 400 tokens at 0.05 s: busy until closed
            return client(url).chat.completions.create(model="fake", messages=QUESTION, max_tokens=400, stream=True)

        active = long_stream()  # returns once it has started: the only slot is taken
        waiting: list = []
        queued = threading.Thread(target=lambda: waiting.append(long_stream()))
        queued.start()
        while scheduler.load()["queued"] == 0:
            time.sleep(0.01)
        with pytest.raises(openai.APIStatusError) as full:
            client(url).chat.completions.create(model="fake", messages=QUESTION, max_tokens=2)
        assert full.value.status_code == 503 and full.value.body["code"] == "queue_full"
        assert int(full.value.response.headers["retry-after"]) >= 1
        active.close()  # the waiting one starts now
        queued.join(30)
        waiting[0].close()


def test_a_client_that_disconnects_mid_stream_cancels_its_generation():
    with serve_in_thread(fake_session(delay=0.05), "fake") as (url, scheduler):
        stream = client(url).chat.completions.create(model="fake", messages=QUESTION, max_tokens=400, stream=True)
        got = [next(iter(stream)) for _ in range(3)]
        assert got[-1].choices[0].delta.content
        started = time.monotonic()
        stream.close()
        while scheduler.load()["active"]:
            assert time.monotonic() - started < 3, "the generation went on after the client left"
            time.sleep(0.02)
        assert scheduler.served == 1  # ended (cancelled) well before its 400 tokens (20 s at this delay)


def test_a_public_address_without_a_key_is_refused_before_loading(capsys):
    assert cli.main(["serve", "--backend", "fake", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--api-key" in err and "0.0.0.0" in err


def test_torch_on_the_cpu_serves_with_one_core_left_for_http_unless_told(monkeypatch):
    from localctx.app.commands.serve import torch_serving_threads

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    monkeypatch.setenv("LOCALCTX_TORCH_DEVICE", "cpu")
    monkeypatch.delenv("LOCALCTX_TORCH_THREADS", raising=False)
    assert torch_serving_threads() == 3
    assert os.environ["LOCALCTX_TORCH_THREADS"] == "3"  # what the torch backend reads as it loads
    monkeypatch.setenv("LOCALCTX_TORCH_THREADS", "4")
    assert torch_serving_threads() is None and os.environ["LOCALCTX_TORCH_THREADS"] == "4"  # the user's choice
    monkeypatch.delenv("LOCALCTX_TORCH_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert torch_serving_threads() is None and "LOCALCTX_TORCH_THREADS" not in os.environ  # nothing to spare
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    monkeypatch.setenv("LOCALCTX_TORCH_DEVICE", "cuda")
    assert torch_serving_threads() is None and "LOCALCTX_TORCH_THREADS" not in os.environ  # a GPU decodes


def test_sixteen_concurrent_clients_all_get_their_own_answer():
    """The bounded load test's shape (benchmarks/serving/serve_load.py measures it on a real model):
    16 clients × 2 requests against one slot and a queue of 32 — no errors, no mixed-up answers."""
    with serve_in_thread(fake_session(delay=0.002), "fake", limits=Limits(max_queue=32)) as (url, scheduler):
        c = client(url)
        answers, errors = {}, []
        barrier = threading.Barrier(16)

        def run(k: int) -> None:
            barrier.wait()
            for r in range(2):
                words = f"client {k} request {r} asks"
                try:
                    stream = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": words}],
                                                       max_tokens=6, temperature=0, stream=True)
                    answers[(k, r)] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
                except openai.OpenAIError as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(answers) == 32 and scheduler.served == 32
        for (k, r), text in answers.items():
            assert text == f"Reply: client {k} request {r} asks "
