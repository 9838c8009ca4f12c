"""Reuse on llama.cpp with the real bundled SmolLM2: prompt-lookup speculation leaves greedy output
unchanged (fp16, q8_0, q4_0 KV and the sinks + window context shift), the prompt cache on disk
answers a second question as a cold run does, and an edited middle message keeps the prefix."""
from __future__ import annotations

import pydoc_data.topics as topics
import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.kvcache import prompt_cache
from localctx.kvcache.prompt_cache import CHUNK

pytestmark = pytest.mark.slow

PASSAGE = topics.topics["calls"].strip()[:700]
PROMPTS = [
    [{"role": "user", "content": "Copy this text exactly:\n\n" + PASSAGE}],
    [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers, then the same function with type hints."}],
]


def tokens_of(session, prompt, speculate: str, n: int = 48):
    session.reset()
    events = list(session.generate(prompt, GenerationParams(max_tokens=n, speculate=speculate)))
    return [e.token for e in events if e.kind == "token"], events[-1].stats


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4", "fp16+sink4+win200"])
def test_greedy_output_is_identical_with_and_without_prompt_lookup(kv):
    with open_session(SessionRequest(model=None, backend="llamacpp", kv=kv, context=1024)) as s:
        accepted = 0
        for prompt in PROMPTS:
            plain, _ = tokens_of(s, prompt, "off")
            drafted, stats = tokens_of(s, prompt, "ngram")
            assert drafted == plain
            assert stats.speculate == "ngram"
            accepted += stats.accepted_tokens
        assert accepted > 0  # the copy prompt at least drafts tokens the model agrees with


def test_a_second_question_loads_the_document_from_disk_and_answers_as_a_cold_run():
    doc = "\n\n".join(topics.topics[k].strip() for k in ("calls", "assignment", "if"))[:6000]
    q1 = [{"role": "user", "content": doc + "\n\nWhat is a call?"}]
    q2 = [{"role": "user", "content": doc + "\n\nWhat does 'if' do?"}]
    req = SessionRequest(model=None, backend="llamacpp", kv="int4", context=2048, prompt_cache=True)
    cold_req = SessionRequest(model=None, backend="llamacpp", kv="int4", context=2048)
    with open_session(cold_req) as s:
        cold, _ = tokens_of(s, q2, "off", n=24)
    with open_session(req) as s:
        _, first = tokens_of(s, q1, "off", n=4)
        per_token = s.kv_state()[0] // s.kv_state()[1]
    [entry] = prompt_cache.entries()
    n_file = int(entry.meta["n_tokens"])
    assert n_file == (first.prompt_tokens - 1) // CHUNK * CHUNK >= CHUNK
    with open_session(req) as s:
        hit, stats = tokens_of(s, q2, "off", n=24)
    assert stats.loaded_tokens == n_file
    assert hit == cold
    # llama.cpp's own state format: the q4_0 K/V rows plus a little per-cell bookkeeping
    assert 0 <= entry.size - n_file * per_token < 32 * n_file + 8192


@pytest.mark.parametrize("kv", ["fp16", "fp16+sink4+win1000"])
def test_an_edited_middle_message_reuses_the_prefix_before_it(kv):
    turns = [{"role": "user", "content": "Name three colours."},
             {"role": "assistant", "content": "Red, green and blue."},
             {"role": "user", "content": "Name three animals."},
             {"role": "assistant", "content": "A cat, a dog and a horse."},
             {"role": "user", "content": "Which of them is the largest?"}]
    with open_session(SessionRequest(model=None, backend="llamacpp", kv=kv, context=1024)) as s:
        list(s.generate(turns, GenerationParams(max_tokens=4)))
        edited = [dict(t) for t in turns]
        edited[2]["content"] = "Name three fruits."
        old, new = s.tokenize(turns), s.tokenize(edited)
        common = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
        events = list(s.generate(edited, GenerationParams(max_tokens=8)))
        assert events[-1].stats.cached_tokens == common
        again = [e.token for e in events if e.kind == "token"]
        s.reset()
        assert again == [e.token for e in s.generate(edited, GenerationParams(max_tokens=8)) if e.kind == "token"]
