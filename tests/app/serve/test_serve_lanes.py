"""Per-request KV policies in localctx serve (app/serve/lanes.py): a request's ``localctx.kv``
runs in a lane of its own on the loaded weights, within the started plan's KV budget; idle lanes
close least recently used first to make room; what cannot fit is refused (400, or 503 while busy
lanes hold the room), never run out of memory. The fake backend for the HTTP side; a tiny
random-weight model on torch for answers against a session of that policy and shared weights."""
from __future__ import annotations

import threading
import time

import openai
import pytest
import torch

from localctx.app.serve.lanes import LaneRefused
from localctx.app.serve.scheduler import Limits
from localctx.backends.base import GenerationParams
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from serve_helpers import serve_in_thread
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

QUESTION = [{"role": "user", "content": "where do the sinks keep tokens"}]
LANES = Limits(kv_lanes_per_min=1000)  # the operator allows per-request policies (--kv-lanes), unbounded here


def fake_session(policy: str = "fp16", context: int = 4096, delay: float = 0.0):
    return FakeBackend(delay).load(None, Plan.fixed("fake", FAKE_SPEC, KVPolicy.parse(policy), context))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)


def ask(c: openai.OpenAI, kv: str | None = None, context: int | None = None, max_tokens: int = 4,
        messages=QUESTION):
    ext = {k: v for k, v in (("kv", kv), ("context", context)) if v is not None}
    return c.chat.completions.create(model="fake", messages=messages, max_tokens=max_tokens, temperature=0,
                                     extra_body={"localctx": ext} if ext else None)


def lanes_of(c: openai.OpenAI) -> list[tuple[str, int]]:
    card = c.models.list().data[0].model_extra["localctx"]
    return [(lane["policy"], lane["context"]) for lane in card["lanes"]]


def test_a_request_policy_runs_in_its_own_lane_and_idle_lanes_close_lru():
    with serve_in_thread(fake_session(), "fake", limits=LANES) as (url, scheduler):
        c = client(url)
        budget = cost.max_kv_bytes(FAKE_SPEC, KVPolicy.parse("fp16"), 4096)
        long_question = [{"role": "user", "content": "sinks " * 100}]  # past a few quantization groups
        int8 = ask(c, kv="int8", messages=long_question)
        ext = int8.model_extra["localctx"]
        assert ext["policy"] == "int8" and ext["exact"] is False and ext["kv_layout"].startswith("lossy")
        assert ext["kv_reserved_bytes"] == cost.max_kv_bytes(FAKE_SPEC, KVPolicy.parse("int8"), 4096)
        fp16 = ask(c, messages=long_question)
        assert int8.choices[0].message.content == fp16.choices[0].message.content  # same model, same words
        assert ext["kv_tokens"] == fp16.model_extra["localctx"]["kv_tokens"] > 100
        assert ext["kv_bytes"] == cost.kv_bytes(FAKE_SPEC, KVPolicy.parse("int8"), ext["kv_tokens"])
        assert ext["kv_bytes"] < fp16.model_extra["localctx"]["kv_bytes"]  # same tokens, fewer bytes
        card = c.models.list().data[0].model_extra["localctx"]
        assert card["plan"]["policy"] == "fp16" and card["kv_budget"] == budget  # /v1/models: the served plan
        # fp16 and int8 together are over the budget: the idle int8 lane was closed for fp16 to come back
        assert lanes_of(c) == [("fp16", 4096)]
        ask(c, kv="int4")
        int4_bytes = cost.max_kv_bytes(FAKE_SPEC, KVPolicy.parse("int4"), 4096)
        assert int4_bytes * 2 < budget  # int4 fits beside a window lane without closing it
        window = ask(c, kv="fp16+sink4+win256")
        assert window.model_extra["localctx"]["policy"] == "fp16+sink4+win256"
        assert lanes_of(c) == [("int4", 4096), ("fp16+sink4+win256", 4096)]
        assert ask(c, kv="int4").model_extra["localctx"]["policy"] == "int4"  # served by its open lane
        assert scheduler.streams.opened == 5  # fp16, int8, fp16 again, int4, window; the last int4 reused
        ask(c, kv="fp16", context=2600)  # needs room: the window lane (least recently used) closes, int4 stays
        assert lanes_of(c) == [("int4", 4096), ("fp16", 2600)]


def test_a_smaller_context_is_honoured_and_a_policy_over_the_budget_is_400():
    with serve_in_thread(fake_session("int4", context=4096), "fake", limits=LANES) as (url, _):
        c = client(url)
        with pytest.raises(openai.BadRequestError) as bad:
            ask(c, kv="fp16")  # fp16 at the served 4,096 tokens is over the int4 plan's bytes
        err = bad.value.body
        assert err["code"] == "kv_budget_exceeded"
        assert "KV policy fp16 at 4,096 tokens needs" in err["message"] and "localctx.context" in err["message"]
        small = ask(c, kv="fp16", context=24, max_tokens=2000)  # the whole answer would take 30 tokens
        ext = small.model_extra["localctx"]
        assert ext["policy"] == "fp16" and ext["exact"] is True and ext["context"] == 24
        assert small.usage.total_tokens == 24 and small.choices[0].finish_reason == "length"
        assert lanes_of(c) == [("fp16", 24)]  # the int4 lane was idle: closed to make room


def test_a_lane_that_fails_to_open_gives_back_the_idle_lanes_closed_for_it(monkeypatch):
    with serve_in_thread(fake_session(), "fake", limits=LANES) as (url, scheduler):
        c = client(url)
        first = ask(c).choices[0].message.content
        lanes = scheduler.streams
        real_open = lanes.maker.open

        def open_but_not_int8(plan):
            if str(plan.policy) == "int8":
                raise UserError("no room for it in this test")
            return real_open(plan)

        monkeypatch.setattr(lanes.maker, "open", open_but_not_int8)
        with pytest.raises(openai.BadRequestError) as bad:
            ask(c, kv="int8")  # int8 beside fp16 is over the budget: the idle fp16 lane was closed for it
        assert bad.value.body["code"] == "kv_policy_unavailable" and "no room for it" in bad.value.body["message"]
        assert lanes_of(c) == [("fp16", 4096)]  # ...and is open again
        opened = lanes.opened
        assert ask(c).choices[0].message.content == first
        assert lanes.opened == opened  # served by that lane, not a new one


def test_a_lane_that_fits_only_once_busy_lanes_finish_is_503_with_retry_after():
    with serve_in_thread(fake_session("int4", context=4096, delay=0.05), "fake", limits=LANES) as (url, scheduler):
        c = client(url)
        done = threading.Event()

        def long_answer() -> None:
            ask(c, max_tokens=40)
            done.set()

        runner = threading.Thread(target=long_answer)
        runner.start()
        deadline = time.monotonic() + 10
        while not scheduler.load()["active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.APIStatusError) as busy:
            ask(c, kv="fp16", context=1024)
        assert busy.value.status_code == 503 and busy.value.response.headers["retry-after"] == "1"
        assert busy.value.body["code"] == "kv_budget_busy" and "int4 at 4,096 tokens" in busy.value.body["message"]
        runner.join(30)
        assert done.is_set()
        assert ask(c, kv="fp16", context=1024).model_extra["localctx"]["policy"] == "fp16"


def test_two_lanes_stream_at_once_and_a_lane_that_breaks_fails_only_its_own_requests():
    with serve_in_thread(fake_session("fp16", context=4096, delay=0.1), "fake", limits=LANES) as (url, scheduler):
        c = client(url)  # int4 and the window together fit the fp16 plan's budget (the idle fp16 lane makes room)
        results: dict = {}

        def run(name: str, kv: str | None) -> None:
            try:
                results[name] = ask(c, kv=kv, max_tokens=40).choices[0].message.content
            except openai.APIStatusError as exc:
                results[name] = exc

        threads = [threading.Thread(target=run, args=("int4", "int4")),
                   threading.Thread(target=run, args=("window", "fp16+sink4+win256"))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while scheduler.load()["active"] < 2:  # two lanes, one stream each, decoding in the same steps
            assert time.monotonic() < deadline, "the two lanes never streamed together"
            time.sleep(0.01)
        window = next(lane for lane in scheduler.streams.lanes if lane.plan.policy.evicts)

        def broken_step():
            raise RuntimeError("the window lane broke")

        window.streams.step = broken_step
        for t in threads:
            t.join(30)
    assert isinstance(results["window"], openai.InternalServerError)
    assert "the window lane broke" in results["window"].body["message"]
    assert results["int4"].startswith("Reply: where do the sinks")  # the other lane went on


def test_per_request_policies_are_off_unless_the_operator_allows_them_and_bounded_when_on():
    with serve_in_thread(fake_session(), "fake") as (url, scheduler):  # serve's default: --kv-lanes 0
        c = client(url)
        with pytest.raises(openai.BadRequestError) as bad:
            ask(c, kv="int8")
        assert bad.value.body["code"] == "kv_lanes_off" and "--kv-lanes" in bad.value.body["message"]
        assert ask(c, kv="fp16").model_extra["localctx"]["policy"] == "fp16"  # the served policy is no lane
        assert ask(c, context=64).model_extra["localctx"]["context"] == 64  # nor is a smaller context
        assert scheduler.streams.opened == 1
    with serve_in_thread(fake_session(), "fake", limits=Limits(kv_lanes_per_min=2)) as (url, scheduler):
        c = client(url)
        ask(c, kv="int8")  # opens int8 (closing the idle fp16 lane: both do not fit)
        ask(c)  # opens fp16 again: the second lane this minute
        with pytest.raises(openai.APIStatusError) as busy:  # alternating policies would reopen pools each time
            ask(c, kv="int8")
        assert busy.value.status_code == 503 and busy.value.body["code"] == "kv_lanes_busy"
        assert 1 <= int(busy.value.response.headers["retry-after"]) <= 60
        assert ask(c).model_extra["localctx"]["policy"] == "fp16"  # an open lane still serves
        assert scheduler.streams.opened == 3


def test_a_lane_maker_that_raises_anything_refuses_the_request_and_the_scheduler_serves_on(monkeypatch):
    """Opening a lane may fail with any exception (a driver error, a bug): choose() turns it into a
    LaneRefused (500), so it never escapes into the scheduler thread, and later requests are served."""
    with serve_in_thread(fake_session(), "fake", limits=LANES) as (url, scheduler):
        c = client(url)
        lanes = scheduler.streams
        real_open = lanes.maker.open

        def broken_int8(plan):
            if str(plan.policy) == "int8":
                raise RuntimeError("the allocator broke")
            return real_open(plan)

        monkeypatch.setattr(lanes.maker, "open", broken_int8)
        with pytest.raises(LaneRefused) as refused:
            lanes.choose(KVPolicy.parse("int8"), None)
        assert refused.value.status == 500 and "the allocator broke" in refused.value.message
        with pytest.raises(openai.InternalServerError) as failed:
            ask(c, kv="int8")
        assert failed.value.body["code"] == "kv_lane_failed"
        started = time.monotonic()
        assert ask(c).choices[0].message.content.startswith("Reply: where")  # the scheduler thread lives on
        assert time.monotonic() - started < 5


# -- torch: lanes share the loaded model ------------------------------------------------------
OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
PROMPT = [{"role": "user", "content": "the tent in the sea"}]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    cfg = TinyConfig()
    path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", cfg, tiny_weights(cfg, seed=11))
    return load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)


def reference(loaded, policy: str, context: int) -> str:
    session = build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse(policy), context), OPTIONS)
    tokens = [e.token for e in session.generate(PROMPT, GenerationParams(max_tokens=8, temperature=0.0))
              if e.kind == "token"]
    return b"".join(session.tokenizer.token_bytes(t) for t in tokens).decode("utf-8", "replace")


def test_torch_lanes_share_the_weights_and_answer_as_a_session_of_that_policy(loaded):
    served = build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse("fp16"), 200), OPTIONS)
    with serve_in_thread(served, "tiny", parallel=2, limits=LANES) as (url, scheduler):
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)

        def answer(kv: str | None) -> tuple[str, dict]:
            r = c.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=8, temperature=0,
                                          extra_body={"localctx": {"kv": kv}} if kv else None)
            return r.choices[0].message.content, r.model_extra["localctx"]

        with pytest.raises(openai.BadRequestError) as bad:
            answer("k8v4")  # quantized groups of 32 do not fit the tiny model's head dim of 8
        assert bad.value.body["code"] == "kv_policy_unavailable" and "head dim 8" in bad.value.body["message"]
        text, ext = answer("fp16+sink4+win64")
        assert ext["policy"] == "fp16+sink4+win64" and ext["exact"] is False
        assert text == reference(loaded, "fp16+sink4+win64", 200)
        lanes = scheduler.streams.lanes
        # each of the 2 slots may hold the window (68 tokens + a group of 32): 200 tokens of fp16 KV,
        # which with the fp16 lane's 200 is over the budget (the plan's 200): the idle fp16 lane was closed
        assert ext["kv_reserved_bytes"] == cost.max_kv_bytes(served.spec, KVPolicy.parse("fp16"), 200)
        assert [str(lane.plan.policy) for lane in lanes] == ["fp16+sink4+win64"]
        assert lanes[0].streams.session.engine.model is served.engine.model  # the weights are loaded once
        assert served.engine.cache is None  # the closed lane's KV pool was freed
        text, ext = answer(None)
        assert ext["policy"] == "fp16" and ext["exact"] is True and text == reference(loaded, "fp16", 200)
        assert [str(lane.plan.policy) for lane in scheduler.streams.lanes] == ["fp16"]
