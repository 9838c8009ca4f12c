"""llama.cpp's shift-based chunk reuse (backends/llamacpp/cache_reuse.py): which cached runs move
where, where it does not apply, and on the real bundled SmolLM2 that a conversation with a middle
message removed prefills only the last token, with next-token logits close to a cold prefill's."""
from __future__ import annotations

import numpy as np
import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.backends.fake.session import FAKE_SPEC
from localctx.backends.llamacpp.cache_reuse import ChunkMove, plan_moves, refusal
from localctx.backends.llamacpp.shift import LlamaCppSettings
from localctx.backends.llamacpp.session import REPLAY
from localctx.kvcache.errors import UserError


# -- the scan (no model) ------------------------------------------------------------------------------
def test_a_removed_middle_run_moves_the_run_after_it_down():
    cached = [1, 2, 3, 10, 11, 12, 20, 21, 22, 23, 24, 9]
    prompt = [1, 2, 3, 20, 21, 22, 23, 24, 30, 31]  # 10..12 removed, a new question after the kept run
    assert plan_moves(cached, prompt, 3, min_run=4) == [ChunkMove(src=6, dst=3, n=5)]


def test_two_runs_with_removed_text_between_them_both_move():
    cached = [1, 5, 6, 7, 8, 0, 0, 9, 9, 9, 9, 4]
    prompt = [1, 6, 7, 8, 9, 9, 9, 9, 4]  # 5 and the two 0s removed; the final 4 is evaluated again
    assert plan_moves(cached, prompt, 1, min_run=3) == [ChunkMove(2, 1, 3), ChunkMove(7, 4, 4)]


def test_a_run_shorter_than_the_minimum_is_not_reused():
    cached = [1, 2, 10, 20, 21, 22, 5]
    prompt = [1, 2, 20, 21, 22, 7]
    assert plan_moves(cached, prompt, 2, min_run=4) == []
    assert plan_moves(cached, prompt, 2, min_run=3) == [ChunkMove(3, 2, 3)]


def test_nothing_to_reuse_when_the_prompt_continues_with_new_text():
    cached = [1, 2, 3, 4, 5, 6]
    assert plan_moves(cached, [1, 2, 7, 8, 9, 3, 4, 5, 6, 0], 2, min_run=2) == []  # text inserted: no run follows
    assert plan_moves(cached, [1, 2, 3, 4, 5, 6, 7], 6, min_run=1) == []  # the cache is all prefix
    assert plan_moves([], [1, 2, 3], 0, min_run=1) == []


def test_the_prompts_last_token_is_left_for_the_logits():
    cached = [1, 0, 0, 5, 6, 7, 8]
    assert plan_moves(cached, [1, 5, 6, 7, 8], 1, min_run=2) == [ChunkMove(3, 1, 3)]


# -- where it does not apply (decided before llama.cpp is asked) -----------------------------------
@pytest.mark.parametrize("settings, n_swa, words", [
    (LlamaCppSettings(n_ctx=1004, type_k="f16", type_v="f16", flash_attn=False, sinks=4, window=1000,
                      shift_chunk=62, swa_full=True), None, "context shift"),
    (LlamaCppSettings(n_ctx=4096, type_k="f16", type_v="f16", flash_attn=False), 512, "last 512 cells"),
    (LlamaCppSettings(n_ctx=4096, type_k="q4_0", type_v="q4_0", flash_attn=True), None, "use fp16 KV"),
])
def test_refused_where_moving_cells_is_wrong_or_impossible(settings, n_swa, words):
    assert words in refusal(None, settings, FAKE_SPEC, n_swa)


# -- the real model ------------------------------------------------------------------------------------
TURNS = [{"role": "user", "content": "Tell me about the planet Mars in two sentences."},
         {"role": "assistant", "content": "Mars is the fourth planet from the Sun, known as the Red Planet."},
         {"role": "user", "content": "Now tell me about Jupiter in two sentences."},
         {"role": "assistant", "content": "Jupiter is the largest planet in the solar system, a gas giant."},
         {"role": "user", "content": "Which of the two planets is larger?"}]
REMOVED = TURNS[2:]  # the first exchange dropped: what follows it is the same text at earlier positions


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def session():
    with open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=512,
                                     cache_reuse=16)) as s:
        yield s


@pytest.mark.slow
def test_a_removed_middle_message_prefills_only_the_last_token(session):
    from localctx.backends.llamacpp.speculate import last_logits

    s = session
    old, new = s.tokenize(TURNS), s.tokenize(REMOVED)
    start = common_prefix(old, new)
    cold = s.next_token_logits(REMOVED)
    s.reset()
    list(s.generate(TURNS, GenerationParams(max_tokens=1)))
    events = list(s.generate(REMOVED, GenerationParams(max_tokens=4)))
    stats = events[-1].stats
    assert stats.prompt_tokens - stats.cached_tokens == 1
    assert stats.shifted_tokens == len(new) - 1 - start
    assert s._chunks.lossy_below(start + 1) and not s._chunks.lossy_below(start)
    # the moved run's keys were computed after the removed text: close to a cold prefill, not equal
    s.reset()
    list(s.generate(TURNS, GenerationParams(max_tokens=1)))
    s._chunks.apply(new)
    s._prefill(new)
    warm = last_logits(s.llm).copy()
    cosine = float(warm @ cold / np.linalg.norm(warm) / np.linalg.norm(cold))
    assert cosine > 0.99 and int(np.argmax(warm)) == int(np.argmax(cold))
    assert not np.array_equal(warm, cold)  # lossy, as the stats say


@pytest.mark.slow
def test_a_run_shorter_than_the_minimum_or_a_new_conversation_is_prefilled(session):
    s = session
    s.reset()
    list(s.generate(TURNS, GenerationParams(max_tokens=1)))
    s._chunks.min_run = 1000  # longer than anything cached
    try:
        stats = list(s.generate(REMOVED, GenerationParams(max_tokens=1)))[-1].stats
    finally:
        s._chunks.min_run = 16
    start = common_prefix(s.tokenize(TURNS), s.tokenize(REMOVED))
    assert (stats.cached_tokens, stats.shifted_tokens) == (start, 0)
    assert s._chunks.lossy_from is None
    other = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Bonjour ?"}]
    stats = list(s.generate(other, GenerationParams(max_tokens=1)))[-1].stats
    assert stats.shifted_tokens == 0 and stats.cached_tokens == common_prefix(s.tokenize(REMOVED), s.tokenize(other))


@pytest.mark.slow
def test_asked_for_on_quantized_kv_it_is_refused_in_one_line():
    with pytest.raises(UserError, match="--cache-reuse does not apply: moving a run of q4_0 keys"):
        open_session(SessionRequest(model=None, backend="llamacpp", kv="int4", context=256, cache_reuse=16))


def test_a_negative_run_length_or_another_backend_is_refused_before_loading():
    with pytest.raises(UserError, match="--cache-reuse -1 must be 0"):
        open_session(SessionRequest(model=None, backend="fake", cache_reuse=-1))
    with pytest.raises(UserError, match="the plan runs on fake; add --backend llamacpp or drop --cache-reuse"):
        open_session(SessionRequest(model=None, backend="fake", cache_reuse=16))


def test_the_chat_says_how_many_tokens_were_reused_at_moved_positions():
    from localctx.app.chat.widgets.conversation import stats_line
    from localctx.app.history import TurnStats

    line = stats_line(TurnStats(backend="llamacpp", policy="fp16", finish_reason="stop", prompt_tokens=77,
                                cached_tokens=76, generated_tokens=4, shifted_tokens=52))
    assert "1 of 77 prompt tokens prefilled · 52 reused at moved positions (lossy)" in line
    assert "moved" not in stats_line(TurnStats(backend="llamacpp", policy="fp16", finish_reason="stop"))


# -- tiny GGUFs (llama.cpp loads them in a moment) --------------------------------------------------
def tiny_session(tmp_path, arch: str):
    from gguf_tiny import ARCHS, write

    from localctx.backends.llamacpp.backend import LlamaCppBackend
    from localctx.backends.models.spec_reader import gguf_spec
    from localctx.backends.models.ref import resolve
    from localctx.kvcache.plan import Plan
    from localctx.kvcache.policy import KVPolicy

    path = write(tmp_path / f"{arch}.gguf", ARCHS[arch])
    plan = Plan.fixed("llamacpp", gguf_spec(path), KVPolicy.parse("fp16"), 2048)
    return LlamaCppBackend().load(resolve(str(path)), plan), path


def test_moved_cells_never_reach_the_prompt_cache_on_disk(tmp_path):
    """A prompt whose cached prefix ends on a file boundary would save its cache (all but its last
    token: llama.cpp's cells can be cut anywhere); with moved (inexact) cells in that prefix it
    must not, as the same steps without a move do."""
    from localctx.backends.base import StatsClock
    from localctx.kvcache import prompt_cache

    s, path = tiny_session(tmp_path, "llama")
    rng = np.random.default_rng(0)
    a, b, c = ([int(t) for t in rng.integers(10, 250, n)] for n in (50, 600, 600))
    bos = s.llm.token_bos()
    with s:
        assert s.enable_cache_reuse(8) is None and s.enable_prompt_cache(path) is None
        later = [bos] + b[:511] + c  # shares 512 tokens, a file boundary, with what the cache holds
        s.llm.eval([bos] + a + b)
        assert s._chunks.apply([bos] + b + [7]) == 600  # b moved down over a
        s._disk_prefix(later, StatsClock(backend="llamacpp", policy="fp16"))
        assert prompt_cache.entries() == []
        s.reset()
        s.llm.eval([bos] + b)  # the same cells, prefilled exactly
        s._disk_prefix(later, StatsClock(backend="llamacpp", policy="fp16"))
        assert [int(e.meta["n_tokens"]) for e in prompt_cache.entries()] == [len(later) - REPLAY]


def test_a_sliding_window_model_in_the_compact_cache_is_refused(tmp_path):
    s, _ = tiny_session(tmp_path, "gemma3")
    with s:
        assert "sliding-window layers keep only their last 512 cells" in s.enable_cache_reuse(8)


def run_turn(slots, prompt, params):
    """Starts ``prompt`` on the server's slots and steps them until it is done: (stream, done event)."""
    stream, event = slots.start(prompt, params, None)  # None: prefilled a chunk per step
    while event is None or event.kind != "done":
        event = next((e for s, e in slots.step() if s is stream), None)
    return stream, event


@pytest.mark.parametrize("cache_reuse", [8, 0])
def test_a_server_slot_keeps_the_runs_after_a_removed_message(tmp_path, cache_reuse):
    """serve's batched slots: with --cache-reuse the follow-up without its first exchange goes to
    the slot that holds it and prefills one token; without, it starts over in an empty slot."""
    import llama_cpp
    from gguf_tiny import ARCHS, write

    from localctx.backends.llamacpp.serving import open_slots
    from localctx.backends.models.spec_reader import gguf_spec
    from localctx.backends.models.ref import resolve
    from localctx.kvcache.plan import Plan
    from localctx.kvcache.policy import KVPolicy

    path = write(tmp_path / "llama.gguf", ARCHS["llama"])
    plan = Plan.fixed("llamacpp", gguf_spec(path), KVPolicy.parse("fp16"), 1024)
    slots = open_slots(resolve(str(path)), plan, 2, cache_reuse)
    params = GenerationParams(max_tokens=3)
    try:
        first, _ = run_turn(slots, TURNS, params)
        stream, done = run_turn(slots, REMOVED, params)
        new = slots.session.tokenize(REMOVED)
        start = common_prefix(slots.session.tokenize(TURNS), new)
        held = llama_cpp.llama_memory_seq_pos_max(slots.decoder.memory, stream.slot.seq_id) + 1
        assert held == len(stream.slot.history)  # no cell of the old conversation is left past the new one
        if cache_reuse:
            assert stream.slot is first.slot and stream.slot.history[:len(new)] == new
            assert done.stats.cached_tokens == len(new) - 1
            assert done.stats.shifted_tokens == len(new) - 1 - start
        else:
            assert stream.slot is not first.slot
            assert (done.stats.cached_tokens, done.stats.shifted_tokens) == (0, 0)
    finally:
        slots.close()
        slots.session.close()
