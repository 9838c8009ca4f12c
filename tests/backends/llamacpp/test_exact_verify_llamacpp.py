"""Prompt lookup on llama.cpp keeps plain decoding's text: the exact_rows probe finds how many rows a
verify batch may have and still give one-token decoding's logits bit for bit, the session never
drafts past it, and a session opened without flash attention turns it on for its first drafting answer
(without it no verify batch is exact)."""
from __future__ import annotations

import numpy as np
import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.backends.generation.speculation import MAX_DRAFT
from localctx.backends.llamacpp import shift, speculate
from localctx.backends.llamacpp.speculate import LlamaCppVerifier, exact_rows
from localctx.kvcache.calibration import Calibration, FormatCost

pytest.importorskip("llama_cpp")

COPY = [{"role": "user", "content": "Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, "
                                    "limes, oranges, figs, dates, apricots, peaches."}]


def verify_lengths(monkeypatch) -> list[int]:
    """Records the length of every verify step the session runs."""
    seen: list[int] = []
    real = LlamaCppVerifier.step

    def step(self, tokens):
        seen.append(len(tokens))
        return real(self, tokens)

    monkeypatch.setattr(LlamaCppVerifier, "step", step)
    return seen


def test_the_probe_finds_rows_that_match_one_token_steps_and_leaves_the_session_cache_alone():
    with open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=512)) as s:
        list(s.generate(COPY, GenerationParams(max_tokens=1, speculate="ngram")))  # turns flash attention on
        assert s.settings.flash_attn
        s.reset()
        s.llm.eval(s.tokenize(COPY))
        n = int(s.llm.n_tokens)
        verifier = LlamaCppVerifier(s.llm, 512, None)
        try:
            before = verifier.step([11])
            verifier.rollback(1)
            rows = exact_rows(s.llm)
            assert 1 <= rows <= MAX_DRAFT + 1
            assert int(s.llm.n_tokens) == n
            assert np.array_equal(verifier.step([11]), before)
            verifier.rollback(1)
            # checked apart from the probe, in the session's own cache after another text: a verify batch
            # of that many rows gives the logits of as many one-token steps, bit for bit
            tokens = [11, 260, 1345, 314, 253, 1930, 30, 4459, 28][:rows]
            single = np.concatenate([verifier.step([t]) for t in tokens])
            verifier.rollback(rows)
            assert np.array_equal(verifier.step(tokens), single)
            verifier.rollback(rows)
        finally:
            verifier.close()


def test_drafts_never_exceed_the_probed_rows_and_the_stats_say_how_many(monkeypatch):
    from localctx.backends.generation.draft_policy import StepCost

    # drafting is weighed by wall-clock step timings, which a loaded host scatters: pin the extra cost
    # per drafted token at a quiet run's (docs/benchmarks-reuse.md) so that the copy drafts whatever the load
    monkeypatch.setattr(StepCost, "step_ratio", lambda self, n_tokens: 1 + 0.48 * (n_tokens - 1))
    seen = verify_lengths(monkeypatch)
    with open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=512)) as s:
        list(s.generate(COPY, GenerationParams(max_tokens=1, speculate="ngram")))  # flash attention on, as drafts need
        s.reset()
        plain = [e.token for e in s.generate(COPY, GenerationParams(max_tokens=40, speculate="off")) if e.kind == "token"]
        s.reset()
        s.exact_rows = 3  # as if the probe had found 3
        events = list(s.generate(COPY, GenerationParams(max_tokens=40, speculate="ngram")))
    stats = events[-1].stats
    assert stats.verify_exact_rows == 3 and stats.accepted_tokens > 0
    assert max(seen) == 3  # the copy drafts as long as it may, never longer
    assert [e.token for e in events if e.kind == "token"] == plain


def test_a_session_without_flash_attention_turns_it_on_for_its_first_drafting_answer(monkeypatch):
    from localctx.backends.generation.draft_policy import StepCost

    off = Calibration(backend="llamacpp", hardware_key="x", model="m", weight_bytes=1, bandwidth_bytes_s=1,
                      formats={"fp16": FormatCost(0.01, 1e-10, settings={"flash_attn": False})})
    monkeypatch.setattr(shift, "local_calibration", lambda: off)  # fp16 measured faster without it here
    monkeypatch.setattr(StepCost, "step_ratio", lambda self, n_tokens: 1 + 0.48 * (n_tokens - 1))  # as above
    with open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=512)) as s:
        assert not s.settings.flash_attn
        allocated = s.plan.allocated_context
        list(s.generate(COPY, GenerationParams(max_tokens=24, speculate="off")))
        assert not s.settings.flash_attn  # plain answers keep the calibrated choice
        drafted = list(s.generate(COPY, GenerationParams(max_tokens=24, speculate="ngram")))
        assert s.settings.flash_attn and int(s.llm.n_ctx()) == allocated == s.plan.allocated_context
        assert drafted[-1].stats.cached_tokens == 0  # the cells could not move: the prompt was read again
        s.reset()
        plain = list(s.generate(COPY, GenerationParams(max_tokens=24, speculate="off")))
    stats = drafted[-1].stats
    assert stats.speculate == "ngram" and stats.verify_exact_rows >= 2 and stats.accepted_tokens > 0
    assert [e.token for e in drafted if e.kind == "token"] == [e.token for e in plain if e.kind == "token"]


@pytest.mark.slow
def test_prompt_lookup_on_gemma3_keeps_plain_decodings_text(gemma3_path, monkeypatch):
    """Gemma 3 270M's verify batches part from one-token steps past a few rows (3 on this build): the
    probe finds where, and the drafted answers are still plain decoding's, token for token."""
    from localctx.backends.generation.draft_policy import StepCost

    monkeypatch.setattr(StepCost, "step_ratio", lambda self, n_tokens: 1 + 0.48 * (n_tokens - 1))  # as above
    seen = verify_lengths(monkeypatch)
    import pydoc_data.topics as topics

    passage = topics.topics["calls"].strip()[:400]
    prompts = [[{"role": "user", "content": "Copy this text exactly:\n\n" + passage}],
               [{"role": "user", "content": "Explain how ocean tides work, in a few sentences."}]]
    accepted = 0
    with open_session(SessionRequest(model=str(gemma3_path), backend="llamacpp", kv="fp16", context=1024)) as s:
        list(s.generate(prompts[1], GenerationParams(max_tokens=1, speculate="ngram")))  # flash attention on
        for prompt in prompts:
            s.reset()
            plain = [e.token for e in s.generate(prompt, GenerationParams(max_tokens=40, speculate="off"))
                     if e.kind == "token"]
            s.reset()
            events = list(s.generate(prompt, GenerationParams(max_tokens=40, speculate="ngram")))
            assert [e.token for e in events if e.kind == "token"] == plain
            accepted += events[-1].stats.accepted_tokens
        assert 2 <= s.exact_rows <= MAX_DRAFT + 1 and max(seen) <= s.exact_rows
    assert accepted > 0
