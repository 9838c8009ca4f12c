"""Continuous batching on the torch backend (backends/torch/serving.py) on a tiny random-weight
GGUF: streams decoded together give the same tokens as one at a time, a follow-up turn keeps
its slot's KV, admission keeps every stream's worst case within the pool, and concurrent HTTP
clients are decoded in one batch."""
from __future__ import annotations

import dataclasses
import threading

import openai
import pytest
import torch

from localctx.app.serve.streams import make_streams
from localctx.backends.base import GenerationParams
from localctx.backends.generation.stream_source import StreamFailed, StreamSource
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.backends.torch.serving import SlotBatcher
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from serve_helpers import serve_in_thread
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
PROMPTS = [[{"role": "user", "content": text}] for text in
           ("the tent in the sea", "a hat", "in the tent the sea is on the sand", "sea")]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    cfg = TinyConfig()
    path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", cfg, tiny_weights(cfg, seed=11))
    return load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)


def new_session(loaded, context=200, policy="fp16"):
    return build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse(policy), context), OPTIONS)


def alone(loaded, prompt, params) -> list[int]:
    session = new_session(loaded)
    return [e.token for e in session.generate(prompt, params) if e.kind == "token"]


def drain(batcher: SlotBatcher, started) -> dict:
    """``started``: what ``start`` returned, (stream, None): each first event comes from a step."""
    assert all(e is None for _, e in started)
    tokens = {id(s): [] for s, _ in started}
    done = {}
    while batcher.active:
        for s, e in batcher.step():
            if e.kind == "token":
                tokens[id(s)].append(e.token)
            else:
                done[id(s)] = e
    return {k: (tokens[k], done[k]) for k in tokens}


@pytest.mark.parametrize("policy", ["fp16", "fp16+sink4+win160"])
def test_streams_decoded_together_match_one_at_a_time(loaded, policy):
    params = GenerationParams(max_tokens=12)
    batcher = SlotBatcher(new_session(loaded, policy=policy), n_slots=4)
    started = [batcher.start(p, params, None) for p in PROMPTS]
    assert batcher.active == 4
    out = drain(batcher, started)
    assert batcher.widest == 4
    for (stream, _), prompt in zip(started, PROMPTS):
        reference = [e.token for e in new_session(loaded, policy=policy).generate(prompt, params) if e.kind == "token"]
        assert out[id(stream)][0] == reference


def test_ignore_eos_streams_run_to_max_tokens_together_as_alone(loaded):
    """Every token counts as end-of-text here: plain answers stop before their first token; with
    ignore_eos, streams decoded together run their full length, token for token as one alone."""
    session = new_session(loaded)
    session.tokenizer = dataclasses.replace(session.tokenizer, eos_ids=set(range(loaded.spec.vocab_size)))
    plain = GenerationParams(max_tokens=7)
    assert [e.kind for e in session.generate(PROMPTS[0], plain)] == ["done"]
    params = GenerationParams(max_tokens=7, ignore_eos=True)
    batcher = SlotBatcher(session, n_slots=4)
    started = [batcher.start(p, params, None) for p in PROMPTS]
    out = drain(batcher, started)
    for (stream, _), prompt in zip(started, PROMPTS):
        tokens, done = out[id(stream)]
        assert len(tokens) == 7 and done.finish_reason == "length" and done.stats.generated_tokens == 7
        assert tokens == alone(loaded, prompt, params)


def test_a_follow_up_turn_keeps_its_slot_kv_and_matches_a_fresh_prefill(loaded):
    params = GenerationParams(max_tokens=6)
    session = new_session(loaded)
    batcher = SlotBatcher(session, n_slots=2)
    other = batcher.start(PROMPTS[1], params, None)
    first = batcher.start(PROMPTS[0], params, None)
    out = drain(batcher, [first, other])
    answer = session.tokenizer.decode(out[id(first[0])][0])
    follow = PROMPTS[0] + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and the hat?"}]
    n_first = session.count_tokens(PROMPTS[0])
    stream, event = batcher.start(follow, params, None)
    tokens, done = drain(batcher, [(stream, event)])[id(stream)]
    assert done.stats.cached_tokens >= n_first  # the first turn's KV was kept, not prefilled again
    assert stream.slot is first[0].slot
    assert tokens == alone(loaded, follow, params)


def test_a_cancelled_or_failed_batch_forgets_its_slots_and_the_batcher_serves_on(loaded, monkeypatch):
    """The batching sources' shared end of a stream (backends/generation/slots.SlotStreams): a stream
    that finishes leaves its slot holding its conversation; cancel_all and a decode forward that
    fails end every live stream and forget their slots' KV; what the server chooses on torch is a
    StreamSource."""
    params = GenerationParams(max_tokens=8, ignore_eos=True)
    batcher = make_streams(new_session(loaded), 2)
    assert isinstance(batcher, SlotBatcher) and isinstance(batcher, StreamSource)
    assert (batcher.batching, batcher.capacity, batcher.active) == (True, 2, 0)

    def held() -> list[int]:
        return [len(s.history) for s in batcher.slots if batcher.cache.has(s.seq_id)]

    drain(batcher, [batcher.start(PROMPTS[0], params, None)])
    assert held() == [batcher.session.count_tokens(PROMPTS[0]) + 8]  # kept: the prompt and the whole answer
    for end in ("cancel_all", "failed step"):
        started = [batcher.start(p, params, None) for p in PROMPTS[:2]]
        batcher.step()  # both prefilled, each with its first token
        assert batcher.active == 2 and all(s.slot.busy for s, _ in started)
        if end == "cancel_all":
            batcher.cancel_all()
        else:
            def broken(*args):
                raise RuntimeError("decode broke")

            monkeypatch.setattr(batcher.engine, "decode", broken)
            failed = batcher.step()  # one forward for both: each of them fails, the batcher does not raise
            assert [type(e) for _, e in failed] == [StreamFailed, StreamFailed]
            assert all("decode broke" in e.message for _, e in failed)
            monkeypatch.undo()
        assert batcher.active == 0 and held() == [] and not any(s.busy or s.history for s in batcher.slots)
    stream, _ = batcher.start(PROMPTS[1], params, None)
    tokens, done = drain(batcher, [(stream, None)])[id(stream)]
    assert done.stats.cached_tokens == 0 and tokens == alone(loaded, PROMPTS[1], params)


def test_admission_keeps_the_worst_case_of_every_stream_within_the_pool(loaded):
    session = new_session(loaded, context=200)
    batcher = SlotBatcher(session, n_slots=4)
    big = GenerationParams(max_tokens=100)
    pool = batcher.pool
    worst_big = [pool.blocks_for(session.count_tokens(p) + 100) for p in PROMPTS[:2]]
    worst_small = pool.blocks_for(session.count_tokens(PROMPTS[3]) + 4)
    assert sum(worst_big) > pool.n_blocks >= worst_big[0] + worst_small  # the case this test is about
    first = batcher.start(PROMPTS[0], big, None)
    assert first is not None
    assert batcher.start(PROMPTS[1], big, None) is None  # would not fit beside the first one's worst case
    small = batcher.start(PROMPTS[3], GenerationParams(max_tokens=4), None)
    assert small is not None  # a small one still fits beside it
    drain(batcher, [first, small])
    assert batcher.start(PROMPTS[1], big, None) is not None  # room again once the first has finished


def test_concurrent_http_clients_decode_in_one_batch(loaded):
    session = new_session(loaded)
    params = GenerationParams(max_tokens=10, temperature=0.0)
    expected = [alone(loaded, p, params) for p in PROMPTS]
    results: dict[int, str] = {}
    with serve_in_thread(session, "tiny", parallel=4) as (url, scheduler):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        barrier = threading.Barrier(len(PROMPTS))

        def ask(i: int) -> None:
            barrier.wait()
            r = client.chat.completions.create(model="tiny", messages=PROMPTS[i], max_tokens=10, temperature=0)
            results[i] = r.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert scheduler.streams.widest >= 2
    for i, tokens in enumerate(expected):
        text = b"".join(session.tokenizer.token_bytes(t) for t in tokens).decode("utf-8", "replace")
        assert results[i] == text
