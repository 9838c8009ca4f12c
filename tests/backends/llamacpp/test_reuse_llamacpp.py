"""Reuse on llama.cpp with the real bundled SmolLM2: prompt-lookup speculation leaves greedy output
unchanged, token for token (fp16, q8_0, q4_0 KV and the sinks + window context shift), the prompt cache on disk
answers a second question as a cold run does, and an edited middle message keeps the prefix."""
from __future__ import annotations

import pydoc_data.topics as topics
import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.backends.generation.speculation import NO_EXACT_ROWS
from localctx.backends.llamacpp.session import REPLAY
from localctx.kvcache import prompt_cache
from localctx.kvcache.prompt_cache import CHUNK

pytestmark = pytest.mark.slow

PASSAGE = topics.topics["calls"].strip()[:700]
# a copy that runs past 256 tokens, where llama.cpp's fp16 one-token steps take other kernels
LONG_COPY = [{"role": "user", "content": "Copy this text exactly:\n\n" + topics.topics["calls"].strip()[:1300]}]
PROMPTS = [
    [{"role": "user", "content": "Copy this text exactly:\n\n" + PASSAGE}],
    [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers, then the same function with type hints."}],
]


def tokens_of(session, prompt, speculate: str, n: int = 48):
    session.reset()
    events = list(session.generate(prompt, GenerationParams(max_tokens=n, speculate=speculate)))
    return [e.token for e in events if e.kind == "token"], events[-1].stats


def one_token_steps(session, prompt, n: int) -> list[int]:
    """Greedy decoding one llama.cpp step per token (what --speculate off runs), up to the model's
    end-of-generation token, where an answer stops (not included, as in an answer's tokens)."""
    import llama_cpp
    import numpy as np

    session.reset()
    session.llm.eval(session.tokenize(prompt))
    tokens = []
    for _ in range(n):
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(session.llm._ctx.ctx, -1),
                                    shape=(session.llm.n_vocab(),))
        token = int(np.argmax(row))
        if token in session.eog:
            break
        tokens.append(token)
        session.llm.eval([token])
    return tokens


@pytest.mark.parametrize("kv", ["fp16", "int4", "fp16+sink4+win200"])
def test_greedy_output_with_prompt_lookup_is_plain_decoding(kv, monkeypatch):
    """Drafts stay within the verify rows the session's probe found bit-equal to one-token steps
    (speculate.exact_rows, under the session's own flash attention setting), so prompt lookup's tokens
    are plain decoding's."""
    from localctx.backends.generation.draft_policy import StepCost

    # the draft planner weighs drafts by wall-clock step timings, which a loaded machine scatters:
    # pin the extra cost per drafted token at a quiet run's (docs/benchmarks-reuse.md) so that
    # drafting, and so this check, does not depend on the load
    monkeypatch.setattr(StepCost, "step_ratio", lambda self, n_tokens: 1 + 0.48 * (n_tokens - 1))
    with open_session(SessionRequest(model=None, backend="llamacpp", kv=kv, context=1024)) as s:
        on = s.settings.flash_attn
        tokens_of(s, PROMPTS[0], "ngram", n=1)  # the first drafting answer probes its exact rows
        assert s.settings.flash_attn == on  # drafting does not change the session's settings
        assert on if kv == "int4" else on == s.reuse_exact
        accepted = 0
        for prompt in PROMPTS + ([] if "win" in kv else [LONG_COPY]):
            plain = one_token_steps(s, prompt, 32)
            if kv == "fp16":
                assert tokens_of(s, prompt, "off", n=32)[0] == plain
            drafted, stats = tokens_of(s, prompt, "ngram", n=32)
            assert stats.speculate == ("ngram" if s.exact_rows >= 2 else f"off ({NO_EXACT_ROWS})")
            assert stats.verify_exact_rows == s.exact_rows
            assert drafted == plain
            accepted += stats.accepted_tokens
        # where batches of two or more rows are exact, the copy prompt drafts tokens the model agrees with
        assert (accepted > 0) == (s.exact_rows >= 2)


def test_auto_stays_off_on_llamacpp_and_says_why():
    with open_session(SessionRequest(model=None, backend="llamacpp", context=512)) as s:
        _, stats = tokens_of(s, PROMPTS[1], "auto", n=2)
    assert stats.speculate.startswith("off (llama.cpp's multi-token verify matches")


def test_a_second_question_loads_the_document_from_disk_and_answers_as_a_cold_run():
    # ~590 tokens: the first prompt but its last token goes to disk; the second question loads it up
    # to the first token where the questions differ (mid-chunk) and prefills only the rest
    # (lookups over several chunks: test_prompt_cache.py)
    doc = "\n\n".join(topics.topics[k].strip() for k in ("calls", "assignment", "if"))[:2600]
    q1 = [{"role": "user", "content": doc + "\n\nWhat is a call?"}]
    q2 = [{"role": "user", "content": doc + "\n\nWhat does 'if' do?"}]
    req = SessionRequest(model=None, backend="llamacpp", kv="int4", context=1024, prompt_cache=True)
    cold_req = SessionRequest(model=None, backend="llamacpp", kv="int4", context=1024)
    with open_session(cold_req) as s:
        cold, _ = tokens_of(s, q2, "off", n=24)
        ids1, ids2 = s.tokenize(q1), s.tokenize(q2)
    common = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    assert common % CHUNK and common > CHUNK
    with open_session(req) as s:
        _, first = tokens_of(s, q1, "off", n=4)
        per_token = s.kv_state()[0] // s.kv_state()[1]
    [entry] = prompt_cache.entries()
    n_file = int(entry.meta["n_tokens"])
    assert n_file == first.prompt_tokens - REPLAY  # those are evaluated again, as a batch of their own
    with open_session(req) as s:
        hit, stats = tokens_of(s, q2, "off", n=24)
    assert stats.loaded_tokens == stats.cached_tokens == common
    assert hit == cold
    assert len(prompt_cache.entries()) == 1  # the few new tokens made no second copy of the document
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
