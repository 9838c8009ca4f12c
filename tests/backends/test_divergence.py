"""backends/evaluation/divergence.py against a plain NumPy KL: per-row KL(p || q), the mean and 99th
percentile, top-1 agreement and both perplexities; zero for equal rows; rows before ``first``
left out of the figures but kept in the returned log-likelihoods."""
import math

import numpy as np
import pytest

from localctx.backends.evaluation.divergence import DivergenceMeter, compare


def naive_kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    p = np.exp(a - a.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    q = np.exp(b - b.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    return (p * np.log(p / q)).sum(1)


def naive_nll(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    p = np.exp(a - a.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return -np.log(p[np.arange(len(t)), t])


def test_figures_match_a_plain_numpy_kl_row_by_row():
    rng = np.random.default_rng(0)
    ref = rng.normal(0, 3, (37, 50)).astype(np.float32)
    near = ref + rng.normal(0, 0.3, ref.shape).astype(np.float32)
    far = rng.normal(0, 3, ref.shape).astype(np.float32)
    t = rng.integers(0, 50, 37)
    meters = [DivergenceMeter(), DivergenceMeter()]
    nll = compare(ref, [near, far], t, meters, first=5, rows=8)  # blocks of 8 across the `first` boundary
    for logits, meter, rows in ((near, meters[0], nll[1]), (far, meters[1], nll[2])):
        kl = naive_kl(ref.astype(np.float64), logits.astype(np.float64))[5:]
        d = meter.result()
        assert d.scored == 32
        assert d.mean_kld == pytest.approx(kl.mean(), rel=1e-9)
        assert d.p99_kld == pytest.approx(np.percentile(kl, 99), rel=1e-9)
        assert d.max_kld == pytest.approx(kl.max(), rel=1e-9)
        assert d.top1 == pytest.approx((ref.argmax(1) == logits.argmax(1))[5:].mean())
        want = naive_nll(logits.astype(np.float64), t)
        np.testing.assert_allclose(rows, want, rtol=1e-9)  # every row, the unscored ones too
        assert d.ppl == pytest.approx(math.exp(want[5:].mean()), rel=1e-9)
        assert d.ref_ppl == pytest.approx(math.exp(naive_nll(ref.astype(np.float64), t)[5:].mean()), rel=1e-9)
    assert meters[0].result().mean_kld < meters[1].result().mean_kld


def test_equal_rows_diverge_by_exactly_zero_and_agree_everywhere():
    rng = np.random.default_rng(1)
    ref = rng.normal(0, 5, (20, 300)).astype(np.float32)
    meter = DivergenceMeter()
    compare(ref, [ref.copy()], rng.integers(0, 300, 20), [meter])
    d = meter.result()
    assert d.mean_kld == 0.0 and d.p99_kld == 0.0 and d.top1 == 1.0 and d.ppl == d.ref_ppl


def test_no_scored_rows_is_no_result():
    assert DivergenceMeter().result() is None
