"""benchmarks/serving/serve_load.py's figures on hand-made samples: one request's decode rate leaves its
prefill out, the decode-phase aggregate runs from the first first token to the last token, and a
failed request counts in neither."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "serving" / "serve_load.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(PATH.parent))  # its sibling server_process.py, as when run as a script
    spec = importlib.util.spec_from_file_location("serve_load", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["serve_load"]


def sample(bench, started, first, last, tokens, error=None):
    return bench.Sample(first - started, last + 0.01 - started, tokens, 0, started, last + 0.01, first, last, error)


def test_one_request_decode_rate_leaves_the_prefill_out(bench):
    s = sample(bench, 0.0, 2.0, 4.0, 21)  # 2 s to the first token, then 20 tokens in 2 s
    assert s.decode_tok_s == pytest.approx(10.0)
    assert sample(bench, 0.0, 1.0, 1.0, 1).decode_tok_s is None  # one token: no decode rate


def test_decode_phase_runs_from_the_first_first_token_to_the_last_token(bench):
    samples = [sample(bench, 0.0, 1.0, 5.0, 41), sample(bench, 0.0, 3.0, 6.0, 31),
               sample(bench, 0.0, 0.0, 0.0, 0, error="APIError: boom")]
    # (40 + 30) tokens after the first ones, between t = 1 s and t = 6 s
    assert bench.decode_phase_tok_s(samples) == pytest.approx(70 / 5)
    one = bench.versus(samples, one_tok_s=7.0, one_decode_tok_s=7.0)
    assert one["decode_vs_one_client"] == pytest.approx(2.0)
