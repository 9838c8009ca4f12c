"""`plan --calibrate` on llama.cpp times prompt lookup's verify steps (backends/llamacpp/calibrate.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from localctx.backends.generation.speculation import MAX_DRAFT  # noqa: E402
from localctx.backends.llamacpp.calibrate import _open, _verify_costs  # noqa: E402


def test_verify_steps_are_timed_for_every_draft_length_and_rolled_back(smollm2_path):
    llm = _open(smollm2_path, "f16", "f16", False, 128, 1)
    try:
        prompt = llm.tokenize(b"The harbour town begins with a small settlement by the river.", add_bos=True)
        llm.eval(prompt)
        before = llm.n_tokens
        costs = _verify_costs(llm, 128, prompt[-1], rounds=2)
        assert sorted(costs) == list(range(2, MAX_DRAFT + 2))
        assert all(c >= 1.0 for c in costs.values())
        assert llm.n_tokens == before  # every timed step was rolled back
        llm.eval(prompt[:1])  # the context still takes tokens where the prompt ended
        assert llm.n_tokens == before + 1
    finally:
        llm.close()
