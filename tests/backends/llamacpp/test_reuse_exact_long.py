"""A reused prefix answers as a cold run does at the lengths prompts have (llama.cpp, the bundled
SmolLM2): a prompt of a few hundred tokens that extends a cached one, and the same prompt asked again,
give the cold run's logits bit for bit, under whichever flash attention setting the session took
(backends/llamacpp/reuse_probe.py). A 40-token probe once chose flash attention where a 64-row batch
takes another kernel, and a prompt asked again replayed its last token alone, which past ~250 tokens
takes another kernel too (session.REPLAY); both changed these logits by up to 1.0."""
from __future__ import annotations

import numpy as np
import pydoc_data.topics as topics
import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.backends.llamacpp.speculate import last_logits

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp")

DOC = topics.topics["calls"].strip()[:1200]
FIRST = [{"role": "user", "content": "Read this:\n\n" + DOC + "\n\nWhat is a call?"}]
LATER = FIRST + [{"role": "assistant", "content": "A call runs a callable object with arguments."},
                 {"role": "user", "content": "And what happens to keyword arguments?"}]


def prefill_logits(session, prompt) -> tuple[np.ndarray, int]:
    """The logits after ``prompt`` as generate() leaves them (one answer token, never evaluated), and
    how many prompt tokens it reused."""
    events = list(session.generate(prompt, GenerationParams(max_tokens=1)))
    return last_logits(session.llm), events[-1].stats.cached_tokens


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_a_long_prompt_reusing_cached_cells_gives_the_cold_runs_logits(kv):
    with open_session(SessionRequest(model=None, backend="llamacpp", kv=kv, context=1024)) as s:
        n_first, n_later = len(s.tokenize(FIRST)), len(s.tokenize(LATER))
        assert 256 < n_first < n_later < 512
        cold, cached = prefill_logits(s, LATER)
        assert cached == 0
        s.reset()
        prefill_logits(s, FIRST)
        extended, cached = prefill_logits(s, LATER)  # a new turn: the first prompt's cells are reused
        assert cached > 256 and n_later - cached < 64
        assert np.array_equal(extended, cold)
        again, cached = prefill_logits(s, LATER)  # the same prompt again: all but its last REPLAY tokens
        assert cached == n_later - 2
        assert np.array_equal(again, cold)


def test_ngram_without_exact_verify_rows_decodes_plainly_and_says_so(cli, monkeypatch):
    """Where the probe finds no exact rows (remembered as 1), an answer asked for with --speculate ngram is
    plain decoding's and the stats line says why prompt lookup is off."""
    from localctx.backends.llamacpp import reuse_probe

    monkeypatch.setattr(reuse_probe, "cached", lambda key, kind="reuse-exact": 1 if kind == "verify-rows" else None)
    r = cli("run", "--backend", "llamacpp", "--speculate", "ngram", "--max-tokens", "4", "Name a colour.")
    assert r.code == 0 and "prompt lookup off (no exact verify rows for this model and KV here)" in r.err
