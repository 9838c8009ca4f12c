"""A server's slot on a model with sliding layers (Gemma 3) holds a compact SWA cache: each stream keeps
its sliding-layer cells for the window plus a batch, and older ones are dropped as its conversation goes
on. A request that shares only the start of a slot's conversation (another conversation with the same
system prompt) must not reuse that prefix once the cells after it are gone: it is prefilled from the
start and answers as a fresh server does (it used to attend to missing cells and answer garbage)."""
from __future__ import annotations

import dataclasses

import pytest

from localctx.backends.base import GenerationParams
from localctx.backends.models.ref import resolve
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from serve_helpers import finish_one

pytest.importorskip("llama_cpp")


def open_slots(path, context: int):
    from localctx.backends.llamacpp.serving import open_slots as open_
    from localctx.backends.models.spec_reader import gguf_spec

    return open_(resolve(str(path)), Plan.fixed("llamacpp", gguf_spec(path), KVPolicy(), context), 1)


def answer(slots, params: GenerationParams, prompt=None, ids=None) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one request on the slots."""
    slots.start(prompt, params, None, ids=ids)
    tokens, done = finish_one(slots)
    return tokens, done.stats.cached_tokens


def test_a_prefix_whose_window_was_dropped_is_prefilled_again_and_a_recent_one_reused(tmp_path):
    from gguf_tiny import ARCHS, write

    path = write(tmp_path / "gemma3-w32.gguf", dataclasses.replace(ARCHS["gemma3"], sliding_window=32))
    params = GenerationParams(max_tokens=4, ignore_eos=True)
    long = [5 + (i * 7) % 50 for i in range(1000)]  # past the SWA cache's 768 cells: the oldest are dropped
    slots = open_slots(path, 2048)
    try:
        assert not slots.decoder.params.swa_full
        answer(slots, params, ids=long)
        early = long[:200] + [5 + (i * 3) % 40 for i in range(60)]  # departs 800 tokens before the slot's end
        tokens, cached = answer(slots, params, ids=early)
        assert cached == 0
        fresh = open_slots(path, 2048)
        try:
            assert answer(fresh, params, ids=early) == (tokens, 0)
        finally:
            fresh.close()
        answer(slots, params, ids=long)
        late = long[:980] + [5 + (i * 3) % 40 for i in range(20)]  # its window is still held: reused
        assert answer(slots, params, ids=late)[1] >= 980
    finally:
        slots.close()


@pytest.mark.slow
def test_gemma3_answers_a_second_conversation_sharing_the_system_prompt_as_a_fresh_server(gemma3_path):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "architecture.md").read_text()
    system = {"role": "system", "content": "You are a careful assistant. " + doc[:1500]}
    params = GenerationParams(max_tokens=12)
    question = [system, {"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    slots = open_slots(gemma3_path, 8192)
    try:
        answer(slots, params, [system, {"role": "user", "content": doc[1500:9000] + "\n\nSummarize this."}])
        warm = answer(slots, params, question)
        fresh = open_slots(gemma3_path, 8192)
        try:
            cold = answer(fresh, params, question)
        finally:
            fresh.close()
        assert warm == cold  # same tokens, nothing reused: the shared system prompt's window was dropped
        text = slots.session.llm.detokenize(warm[0]).decode()
        assert "Paris" in text
    finally:
        slots.close()
