"""Continuous batching on llama.cpp for the server (backends/llamacpp/serving.py) on the bundled
SmolLM2: streams decoded together start as one at a time does, a follow-up turn keeps its slot's
cells, and the plan's context is split between the slots."""
from __future__ import annotations

import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.backends.generation.stream_source import StreamSource
from localctx.backends.llamacpp.serving import LlamaSlots
from localctx.kvcache.errors import UserError

pytestmark = pytest.mark.slow
PROMPTS = [[{"role": "user", "content": q}] for q in
           ("What is the capital of France?", "Count: one, two,", "Name a fruit.")]


@pytest.fixture(scope="module")
def session():
    s = open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=1024))
    yield s
    s.close()


def drain(slots: LlamaSlots, started) -> dict:
    """``started``: what ``start`` returned, (stream, None): each first event comes from a step."""
    assert all(e is None for _, e in started)
    out = {id(s): ([], None) for s, _ in started}
    while slots.active:
        for s, e in slots.step():
            if e.kind == "token":
                out[id(s)][0].append(e.token)
            else:
                out[id(s)] = (out[id(s)][0], e)
    return out


def test_streams_decoded_together_start_as_one_at_a_time_and_keep_their_slots(session):
    params = GenerationParams(max_tokens=8)
    alone = []
    for p in PROMPTS:
        session.reset()
        alone.append([e.token for e in session.generate(p, params) if e.kind == "token"])
    slots = LlamaSlots(session, n_slots=4)
    try:
        assert slots.per_slot == 256
        started = [slots.start(p, params, None) for p in PROMPTS]
        out = drain(slots, started)
        assert slots.widest == 3
        for (stream, _), reference in zip(started, alone):
            tokens, done = out[id(stream)]
            assert done.finish_reason in ("stop", "length") and tokens
            assert tokens[0] == reference[0]  # the first token comes from the same prompt logits
            assert done.stats.kv_tokens == len(stream.slot.history)
        first = started[0][0]
        answer = "".join(session.llm.detokenize([t], special=False).decode("utf-8", "replace")
                         for t in out[id(first)][0])
        follow = PROMPTS[0] + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And Spain?"}]
        stream, event = slots.start(follow, params, None)
        assert stream.slot is first.slot
        tokens, done = drain(slots, [(stream, event)])[id(stream)]
        assert done.stats.cached_tokens >= session.count_tokens(PROMPTS[0])
        with pytest.raises(UserError, match="slots holds 256 tokens"):
            slots.start([{"role": "user", "content": "word " * 300}], params, None)
    finally:
        slots.close()


def test_a_prompt_asked_again_prefills_its_last_two_tokens_and_answers_as_its_cold_run(session):
    """As the session does (session.REPLAY): a one-row batch takes other llama.cpp kernels than the cold
    run's last rows (on fp16 KV they parted by up to 0.8 in a logit past ~250 tokens), so a slot that holds
    the whole prompt prefills its last two tokens again, not one."""
    from pydoc_data.topics import topics

    from localctx.backends.llamacpp.session import REPLAY

    ask = [{"role": "user", "content": "Summarise: " + topics["assert"][:1400]}]
    params = GenerationParams(max_tokens=24, ignore_eos=True)
    slots = LlamaSlots(session, n_slots=2)
    try:
        cold, cold_done = next(iter(drain(slots, [slots.start(ask, params, None)]).values()))
        n = cold_done.stats.prompt_tokens
        assert n > 280 and cold_done.stats.cached_tokens == 0
        again, again_done = next(iter(drain(slots, [slots.start(ask, params, None)]).values()))
        assert again_done.stats.cached_tokens == n - REPLAY == n - 2
        assert again == cold
    finally:
        slots.close()


def test_a_server_holds_the_plans_kv_once_in_its_slots_not_again_in_the_session():
    from localctx.app.serve.streams import open_streams
    from localctx.app.session_options import plan_session
    from localctx.backends.llamacpp.serving import OWN_CONTEXT

    planned = plan_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=2048))
    session, slots = open_streams(planned, 4)
    try:
        assert isinstance(slots, LlamaSlots) and isinstance(slots, StreamSource)
        assert (slots.batching, slots.capacity, slots.active) == (True, 4, 0)
        assert session.llm.n_ctx() == OWN_CONTEXT < planned.plan.context  # the session's own context is minimal
        assert slots.per_slot * 4 == 2048  # all the plan's cells live in the slots' context
        started = slots.start(PROMPTS[0], GenerationParams(max_tokens=4), None)
        tokens, done = drain(slots, [started])[id(started[0])]
        assert tokens and done.finish_reason in ("stop", "length")
        assert started[0].slot.history and not started[0].slot.busy  # a finished stream's slot keeps its cells
        live = [slots.start(p, GenerationParams(max_tokens=8, ignore_eos=True), None) for p in PROMPTS[1:]]
        assert slots.active == 2 and all(s.seq.sampler is not None for s, _ in live)
        slots.cancel_all()  # ends them: their samplers freed, their slots forgotten
        assert slots.active == 0 and all(s.seq.sampler is None and not s.slot.history for s, _ in live)
    finally:
        slots.close()
        session.close()


def test_a_lane_of_another_policy_is_a_context_on_the_same_weights_with_its_kv_types(session):
    """serve's per-request lanes (app/serve/lanes.py) on llama.cpp: a context of its own on the
    loaded llama_model, with q8_0 keys and values for int8, counted at llama.cpp's row sizes."""
    import dataclasses

    from localctx.app.serve.lane_makers import LlamaCppLanes
    from localctx.backends.llamacpp.allocation import held_bytes
    from localctx.kvcache.policy import KVPolicy

    params = GenerationParams(max_tokens=6)
    session.reset()
    reference = [e.token for e in session.generate(PROMPTS[0], params) if e.kind == "token"]
    lanes = LlamaCppLanes(session, parallel=2, cache_reuse=0)
    assert "context shift" in lanes.refusal(KVPolicy.parse("fp16+sink4+win512"))
    assert lanes.refusal(KVPolicy.parse("int8")) is None
    int8 = lanes.open(dataclasses.replace(session.plan, policy=KVPolicy.parse("int8")))
    try:
        assert int8.decoder.model is session.llm.model  # the weights are loaded once
        started = int8.start(PROMPTS[0], params, None)
        tokens, done = drain(int8, [started])[id(started[0])]
        assert done.stats.policy == "int8" and tokens
        assert done.stats.kv_bytes == held_bytes(session.spec, "q8_0", "q8_0", done.stats.kv_tokens)
        assert done.stats.kv_bytes < session.held_bytes(done.stats.kv_tokens)  # fp16's bytes for as many tokens
        assert tokens[0] == reference[0]  # the same model's logits for the same prompt
    finally:
        lanes.release(int8)
