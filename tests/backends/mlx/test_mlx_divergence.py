"""KL divergence on the MLX backend (backends/mlx/evaluate.py), on SmolLM2-135M: two full-precision
caches in lockstep diverge by exactly 0, a 4-bit cache by more, and its figures equal
a plain NumPy KL over the logits the two caches gave."""
import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends.evaluation.tasks import PerplexityTask  # noqa: E402
from localctx.backends.mlx.evaluate import MLXEvaluator, evaluate  # noqa: E402
from localctx.backends.models.ref import bundled_default_path, resolve  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ev():
    return MLXEvaluator(resolve(str(bundled_default_path())), chunk=64)


def test_two_full_precision_caches_diverge_by_exactly_zero(ev):
    ids = ev.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)[:96]
    sessions = [ev.session(KVPolicy(), 96), ev.session(KVPolicy(), 96)]
    (_, none), (_, same) = ev.lockstep(sessions, ids, PerplexityTask(96, 48))
    assert none is None and same.mean_kld == 0.0 and same.top1 == 1.0 and same.scored == 95


def test_int4_diverges_and_matches_numpy(ev, monkeypatch):
    from localctx.backends.mlx.session import MLXSession

    seen = []
    feed = MLXSession.feed

    def spy(self, tokens, all_logits=False):
        out = feed(self, tokens, all_logits)
        seen.append(np.array(out, dtype=np.float64))
        return out

    monkeypatch.setattr(MLXSession, "feed", spy)
    reports = evaluate(ev, [KVPolicy.parse("int4")], PerplexityTask(97, 48), None)
    d4 = reports[1].divergence
    assert reports[0].divergence is None and d4.mean_kld > 0
    p, q = np.concatenate(seen[0::2]), np.concatenate(seen[1::2])
    lp = p - p.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    lq = q - q.max(1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    kl = (np.exp(lp) * (lp - lq)).sum(1)
    assert d4.scored == 96
    assert d4.mean_kld == pytest.approx(kl.mean(), rel=1e-6)
    assert d4.top1 == pytest.approx((lp.argmax(1) == lq.argmax(1)).mean())
