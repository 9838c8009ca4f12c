"""Prompt lookup on llama.cpp keeps plain decoding's text: the exact_rows probe finds how many rows a
verify batch may have and still give one-token decoding's logits bit for bit, under the session's own
flash attention setting, and the session never drafts past it; drafting never changes that setting, so
``--speculate ngram`` and ``off`` answer alike. The reuse probe (backends/llamacpp/reuse_probe.py)
decides the setting for fp16 once per model, CPU and build, and remembers it."""
from __future__ import annotations

import numpy as np
import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.backends.generation.speculation import MAX_DRAFT, NO_EXACT_ROWS
from localctx.backends.llamacpp import reuse_probe
from localctx.backends.llamacpp.speculate import LlamaCppVerifier, exact_rows

pytest.importorskip("llama_cpp")

COPY = [{"role": "user", "content": "Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, "
                                    "limes, oranges, figs, dates, apricots, peaches."}]


def remembered(exact: bool):
    """``reuse_probe.cached`` as if the reuse probe had found ``exact`` (verify rows: not remembered)."""
    return lambda key, kind="reuse-exact": exact if kind == "reuse-exact" else None


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
        list(s.generate(COPY, GenerationParams(max_tokens=1, speculate="ngram")))
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
    # flash attention on (as where the reuse probe found it exact): 3-row verify batches are exact with it on
    # every CPU tried
    monkeypatch.setattr(reuse_probe, "cached", remembered(True))
    with open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=512)) as s:
        assert s.settings.flash_attn
        s.reset()
        plain = [e.token for e in s.generate(COPY, GenerationParams(max_tokens=40, speculate="off")) if e.kind == "token"]
        s.reset()
        s.exact_rows = 3  # as if the probe had found 3
        events = list(s.generate(COPY, GenerationParams(max_tokens=40, speculate="ngram")))
    stats = events[-1].stats
    assert stats.verify_exact_rows == 3 and stats.accepted_tokens > 0
    assert max(seen) == 3  # the copy drafts as long as it may, never longer
    assert [e.token for e in events if e.kind == "token"] == plain


def test_a_session_without_flash_attention_drafts_only_what_its_own_probe_finds_exact(monkeypatch):
    from localctx.backends.generation.draft_policy import StepCost

    monkeypatch.setattr(reuse_probe, "cached", remembered(False))  # as where reuse was not exact with it
    monkeypatch.setattr(StepCost, "step_ratio", lambda self, n_tokens: 1 + 0.48 * (n_tokens - 1))  # as above
    with open_session(SessionRequest(model=None, backend="llamacpp", kv="fp16", context=512)) as s:
        assert not s.settings.flash_attn and s.reuse_exact is False
        n_ctx = int(s.llm.n_ctx())
        drafted = list(s.generate(COPY, GenerationParams(max_tokens=24, speculate="ngram")))
        assert not s.settings.flash_attn and int(s.llm.n_ctx()) == n_ctx  # the context was not reopened
        s.reset()
        plain = list(s.generate(COPY, GenerationParams(max_tokens=24, speculate="off")))
    stats = drafted[-1].stats
    # where no verify batch is exact the answer decodes plainly and says why
    assert stats.speculate == ("ngram" if s.exact_rows >= 2 else f"off ({NO_EXACT_ROWS})")
    assert stats.verify_exact_rows == s.exact_rows >= 1
    assert (stats.accepted_tokens > 0) == (s.exact_rows >= 2)
    assert [e.token for e in drafted if e.kind == "token"] == [e.token for e in plain if e.kind == "token"]


@pytest.mark.fresh_probes
def test_the_reuse_verdict_is_probed_once_remembered_and_decides_flash_attention(monkeypatch):
    calls = []
    real = reuse_probe.reuse_exact_with_flash_attention

    def probe(llm):
        calls.append(1)
        return real(llm)

    monkeypatch.setattr(reuse_probe, "reuse_exact_with_flash_attention", probe)
    request = SessionRequest(model=None, backend="llamacpp", kv="fp16", context=512)
    with open_session(request) as s:
        first = s.reuse_exact
        assert isinstance(first, bool) and s.settings.flash_attn == first  # uncalibrated: on where exact
    with open_session(request) as s:
        assert s.reuse_exact == first and s.settings.flash_attn == first
    assert len(calls) == 1  # the second session read the verdict
    with open_session(SessionRequest(model=None, backend="llamacpp", kv="int8", context=512)) as s:
        assert s.reuse_exact is None and s.settings.flash_attn  # quantized V: always on, nothing probed
    assert len(calls) == 1
    for path in reuse_probe.verdict_path("x").parent.glob("reuse-exact-*.json"):
        path.write_text("{damaged")
    with open_session(request) as s:
        assert s.reuse_exact == first
    assert len(calls) == 2  # a damaged verdict is probed again


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
        list(s.generate(prompts[1], GenerationParams(max_tokens=1, speculate="ngram")))  # probes its exact rows
        for prompt in prompts:
            s.reset()
            plain = [e.token for e in s.generate(prompt, GenerationParams(max_tokens=40, speculate="off"))
                     if e.kind == "token"]
            s.reset()
            events = list(s.generate(prompt, GenerationParams(max_tokens=40, speculate="ngram")))
            assert [e.token for e in events if e.kind == "token"] == plain
            accepted += events[-1].stats.accepted_tokens
        assert 1 <= s.exact_rows <= MAX_DRAFT + 1 and max(seen, default=1) <= s.exact_rows
    assert (accepted > 0) == (s.exact_rows >= 2)


@pytest.mark.fresh_probes
def test_the_rows_probe_times_its_verify_steps_and_the_session_drafts_by_that_cost(monkeypatch):
    """What a verify step costs depends on the KV type, so the probe that finds the exact rows also times
    them, per model and KV, and prompt lookup weighs drafts by that before the calibration's fp16 figure."""
    import localctx.backends.llamacpp.speculate as speculate

    request = SessionRequest(model=None, backend="llamacpp", kv="int8", context=512)
    with open_session(request) as s:
        calibrated = dict(s.verify_cost)
        rows = s.verify_rows()
        measured = dict(s.verify_cost)
    if rows < 2:
        pytest.skip(f"no exact verify rows for int8 on this CPU ({rows})")
    assert set(measured) == set(range(2, rows + 1)) and all(c >= 1.0 for c in measured.values())
    assert measured != calibrated
    from localctx.backends.generation import speculation

    monkeypatch.setattr(speculate, "exact_rows", lambda *a, **k: pytest.fail("probed again"))
    priors, real_planner = [], speculation.DraftPlanner

    def planner(max_draft, verify_cost=None):
        priors.append(verify_cost)
        return real_planner(max_draft, verify_cost)

    monkeypatch.setattr(speculation, "DraftPlanner", planner)
    with open_session(request) as s:
        assert s.verify_rows() == rows and s.verify_cost == measured  # remembered, both
        list(s.generate(COPY, GenerationParams(max_tokens=4, speculate="ngram")))
    assert priors == [measured]  # the draft planner's prior
