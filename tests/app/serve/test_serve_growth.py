"""A server's KV starts small and grows (kvcache/growth.py) when a request's prompt and answer do not fit
what its slots hold now, up to the plan's context, between steps and without losing a slot's state:
on llama.cpp the slots' cells move into a larger multi-sequence context, on torch every slot's K/V moves
into a larger paged pool. A request that forces growth while another stream decodes gives both the same
greedy tokens as a server that allocated the maximum from the start; the slots are all free after, an
idle slot's cached prefix is reused after growing, and the plan, /metrics and the startup line say
what is allocated beside the maximum. Tiny models; servers on 127.0.0.1."""
from __future__ import annotations

import urllib.request

import openai
import pytest
import torch

from localctx.backends.base import GenerationParams
from localctx.backends.models.ref import ModelRef, resolve
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from serve_helpers import finish_one, serve_in_thread

SHORT = [{"role": "user", "content": "the tent in the sea"}]
LONG = [{"role": "user", "content": "and the hat on the mat by the sea? " * 12}]
DECODING = GenerationParams(max_tokens=60, ignore_eos=True)  # fits the first allocation
GROWING = GenerationParams(max_tokens=300, ignore_eos=True)  # with LONG, more than a first slot holds


def interleaved(slots) -> tuple[list[int], list[int]]:
    """SHORT decodes; after some of its tokens LONG arrives and (on a small server) forces growth;
    both run to their ends. Returns each one's tokens."""
    tokens: dict[int, list[int]] = {}
    done: dict[int, object] = {}

    def step() -> None:
        for s, e in slots.step():
            if e.kind == "token":
                tokens.setdefault(id(s), []).append(e.token)
            else:
                done[id(s)] = e

    first, _ = slots.start(SHORT, DECODING, None)
    while len(tokens.get(id(first), [])) < 10:
        step()
    second, _ = slots.start(LONG, GROWING, None)
    while slots.active:
        step()
    assert done[id(first)].finish_reason == done[id(second)].finish_reason == "length"
    assert not any(s.busy for s in slots.slots)  # every slot free again
    return tokens[id(first)], tokens[id(second)]


def follow_up(slots) -> tuple[list[int], int, int]:
    """A follow-up to the longest conversation a slot holds (its tokens and two more, so that llama.cpp's
    two replayed rows are new ones: session.REPLAY): (tokens, cached
    tokens, tokens the slot held)."""
    held = max(slots.slots, key=lambda s: len(s.history)).history
    n_held = len(held)
    slots.start(None, GenerationParams(max_tokens=8, ignore_eos=True), None, ids=held + held[-2:])
    tokens, done = finish_one(slots)
    return tokens, done.stats.cached_tokens, n_held


# -- llama.cpp -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from gguf_tiny import ARCHS, write

    return write(tmp_path_factory.mktemp("serve-grow") / "llama.gguf", ARCHS["llama"])


def llamacpp_slots(path, allocate: int | None, n_slots: int = 2):
    from localctx.backends.llamacpp.backend import LlamaCppBackend
    from localctx.backends.llamacpp.serving import open_slots
    from localctx.backends.models.spec_reader import gguf_spec

    spec = gguf_spec(path)
    plan = Plan.fixed("llamacpp", spec, KVPolicy(), 2048)
    if allocate is not None:
        backend = LlamaCppBackend()
        plan = plan.sized_to(allocate, backend.kv_cell_tokens, lambda n: backend.kv_allocation()(spec, plan.policy, n))
    return open_slots(resolve(str(path)), plan, n_slots)


def test_llamacpp_slots_grow_while_a_stream_decodes_and_answer_as_the_full_allocation(tiny_gguf):
    full = llamacpp_slots(tiny_gguf, None)
    small = llamacpp_slots(tiny_gguf, 512)
    try:
        assert (full.per_slot, small.per_slot, small.most_per_slot) == (1024, 256, 1024)
        assert small.plan.allocated_context == 512 and small.plan.allocated_bytes < small.plan.kv_bytes
        expected = interleaved(full)
        got = interleaved(small)
        assert got == expected
        need = small.session.count_tokens(LONG) + GROWING.max_tokens
        assert 256 < need <= 768  # the case this test is about: grows once, to whole cells, short of the maximum
        assert small.growths == 1 and small.per_slot == -(-need // 256) * 256
        n_ctx = 2 * small.per_slot
        assert small.plan.allocated_context == n_ctx == small.decoder.params.n_ctx
        assert small.plan.allocated_bytes == small.session.allocated_bytes(n_ctx) < small.plan.kv_bytes
        # the idle slots kept their conversations through the move: a follow-up reuses all they hold
        tokens, cached, held = follow_up(small)
        assert (tokens, cached) == follow_up(full)[:2] and cached == held
        grown = small.per_slot
        with pytest.raises(UserError, match="slots holds 1,024 tokens"):  # past the maximum: refused as before
            small.start([{"role": "user", "content": "sea " * 1100}], GenerationParams(max_tokens=4), None)
        assert small.per_slot == grown and small.active == 0  # a refused request grows nothing, holds nothing
    finally:
        full.close()
        small.close()


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def ask_both(url: str) -> tuple[str, str]:
    """Over HTTP: a streamed SHORT answer decodes while LONG (which forces growth) is asked."""
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    extra = {"ignore_eos": True}
    decoding = client.chat.completions.create(model="tiny", messages=SHORT, max_tokens=DECODING.max_tokens,
                                              temperature=0, stream=True, extra_body=extra)
    pieces = []
    for chunk in decoding:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            break
    long = client.chat.completions.create(model="tiny", messages=LONG, max_tokens=GROWING.max_tokens, temperature=0,
                                          extra_body=extra)
    for chunk in decoding:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces), long.choices[0].message.content


def test_llamacpp_server_grows_and_metrics_show_allocated_beside_the_maximum(tiny_gguf):
    from localctx.app.serve.protocol import RequestRules

    answers, grown = [], []
    for allocate in (None, 512):
        slots = llamacpp_slots(tiny_gguf, allocate)
        with serve_in_thread(slots.session, "tiny", streams=slots, rules=RequestRules(ignore_eos=True)) as (url, sched):
            before = metric(url, "localctx_kv_allocated_bytes")
            assert metric(url, "localctx_kv_reserved_bytes") >= before
            answers.append(ask_both(url))
            grown.append((before, metric(url, "localctx_kv_allocated_bytes"), metric(url, "localctx_slots_busy")))
            assert sched.load()["active"] == 0
    assert answers[0] == answers[1]
    (full_before, full_after, _), (small_before, small_after, busy) = grown
    assert full_before == full_after  # the full allocation never grows
    assert small_before < small_after < full_after and busy == 0


# -- torch ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_torch(tmp_path_factory):
    from localctx.backends.torch.loading import TorchOptions, load_model
    from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

    cfg = TinyConfig()
    path = write_gguf(tmp_path_factory.mktemp("serve-grow-torch") / "tiny.gguf", cfg, tiny_weights(cfg, seed=11))
    options = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
    return load_model(ModelRef("gguf", path, "tiny", "file"), options), options


def torch_batcher(tiny_torch, allocate: int | None, n_slots: int = 2):
    from localctx.backends.torch.loading import build_session
    from localctx.backends.torch.serving import SlotBatcher

    loaded, options = tiny_torch
    plan = Plan.fixed("torch", loaded.spec, KVPolicy(), 1024)
    if allocate is not None:
        plan = plan.sized_to(allocate, options.block_size, lambda n: cost.max_kv_bytes(loaded.spec, plan.policy, n))
    return SlotBatcher(build_session(loaded, plan, options), n_slots)


def test_torch_pool_grows_while_a_stream_decodes_and_answers_as_the_full_allocation(tiny_torch):
    full = torch_batcher(tiny_torch, None)
    small = torch_batcher(tiny_torch, 160)
    assert (full.pool.capacity_tokens, small.pool.capacity_tokens) == (1024, 160)
    expected = interleaved(full)
    got = interleaved(small)
    assert got == expected
    assert small.growths >= 1 and 320 <= small.pool.capacity_tokens == small.session.plan.allocated_context < 1024
    plan = small.session.plan
    assert plan.allocated_bytes == cost.max_kv_bytes(small.session.spec, plan.policy, plan.allocated_context)
    # the idle slots kept their K/V through the move: a follow-up reuses all they hold
    tokens, cached, held = follow_up(small)
    assert (tokens, cached) == follow_up(full)[:2] and cached == held
    grown = small.pool.capacity_tokens
    with pytest.raises(UserError, match="the context holds 1,024"):  # past the maximum: refused as before
        small.start([{"role": "user", "content": "sea " * 1100}], GenerationParams(max_tokens=4), None)
    assert small.pool.capacity_tokens == grown and small.active == 0  # a refused request grows nothing


def test_torch_server_grows_and_metrics_show_it(tiny_torch):
    from localctx.app.serve.protocol import RequestRules

    answers, grown = [], []
    for allocate in (None, 160):
        batcher = torch_batcher(tiny_torch, allocate)
        with serve_in_thread(batcher.session, "tiny", streams=batcher, rules=RequestRules(ignore_eos=True)) as (url, _):
            before = metric(url, "localctx_kv_allocated_bytes")
            answers.append(ask_both(url))
            grown.append((before, metric(url, "localctx_kv_allocated_bytes"), metric(url, "localctx_slots_busy")))
    assert answers[0] == answers[1]
    (full_before, full_after, _), (small_before, small_after, busy) = grown
    assert full_before == full_after
    assert small_before < small_after <= full_after and busy == 0


# -- the CLI ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_localctx_serve_starts_at_parallel_slots_of_1024_tokens_and_says_allocated_beside_the_maximum():
    """The bundled SmolLM2 (8K trained context) with --context 4096 and two slots: 2 × 1,024 tokens at
    start; a request whose prompt and max_tokens need more than a slot's 1,024 grows them to the maximum."""
    from serve_helpers import serve_subprocess

    with serve_subprocess(["--backend", "llamacpp", "--kv", "fp16", "--context", "4096", "--parallel", "2"]) \
            as (proc, url):
        assert "allocated for 2,048 tokens, grows to" in proc.startup_line and "at 4,096" in proc.startup_line
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        plan = client.models.list().data[0].model_extra["localctx"]["plan"]
        assert (plan["allocated_context"], plan["context"]) == (2048, 4096)
        assert plan["allocated_kv_bytes"] < plan["kv_bytes"]
        start = metric(url, "localctx_kv_allocated_bytes")
        assert start == plan["allocated_kv_bytes"] < metric(url, "localctx_kv_reserved_bytes")
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=1500, temperature=0, stop=["."])
        assert r.choices[0].message.content is not None
        plan = client.models.list().data[0].model_extra["localctx"]["plan"]
        assert plan["allocated_context"] == 4096 and plan["allocated_kv_bytes"] == plan["kv_bytes"]
        assert metric(url, "localctx_kv_allocated_bytes") > start and metric(url, "localctx_slots_busy") == 0
