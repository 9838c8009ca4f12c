"""KL divergence on the torch backend (backends/torch/evaluate.py), on a tiny random-weight model:
two full-precision caches in lockstep diverge by exactly 0; a 4-bit cache diverges by more; and the
figures equal a plain NumPy KL between an independent cache-free forward (torch_tiny_models.py's
reference_logits, the full-precision side) and the 4-bit cache's logits as the evaluator saw them."""
import math

import numpy as np
import pytest
import torch

from localctx.backends.evaluation.tasks import PerplexityTask, text_tokens
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.evaluate import PolicyEvaluator, evaluate
from localctx.backends.torch.loading import TorchOptions, load_model
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import TinyConfig, reference_logits, tiny_weights, write_gguf

FP32 = TorchOptions(device="cpu", dtype=torch.float32, block_size=4, prefill_chunk=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = TinyConfig(head_dim=32, hidden=64, context=1024)
    w = tiny_weights(cfg, seed=4)
    path = write_gguf(tmp_path_factory.mktemp("kld") / "t.gguf", cfg, w)
    loaded = load_model(ModelRef("gguf", path, "tiny", "file"), FP32)
    return cfg, w, PolicyEvaluator(loaded.model, loaded.tokenizer)


def ids_for(n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(5).integers(0, 260, n)]


def test_two_full_precision_caches_diverge_by_exactly_zero(tiny):
    _, _, ev = tiny
    (_, none), (_, same) = ev.lockstep([KVPolicy(), KVPolicy()], ids_for(300), PerplexityTask(300, 64))
    assert none is None  # the reference itself
    assert same.mean_kld == 0.0 and same.p99_kld == 0.0 and same.top1 == 1.0 and same.scored == 299


def test_a_4_bit_cache_matches_numpy_kl_from_an_independent_full_precision_forward(tiny, monkeypatch):
    cfg, w, ev = tiny
    ids = text_tokens(ev.tokenizer, 300)  # what evaluate streams
    assert len(ids) == 300
    seen = []  # the int4 cache's logits, chunk by chunk, as the evaluator computed them
    forward = ev._forward

    def spy(cache, chunk, all_logits):
        out = forward(cache, chunk, all_logits)
        seen.append(out.float().numpy().copy())
        return out

    monkeypatch.setattr(ev, "_forward", spy)
    reports = evaluate(ev, [KVPolicy.parse("int4")], PerplexityTask(300, 64, score_from=10), None)
    d = reports[1].divergence
    assert reports[0].divergence is None and d.mean_kld > 1e-4  # lossy: measurably off
    ref = reference_logits(cfg, w, ids)[:-1].double().numpy()
    q = np.concatenate(seen[1::2]).astype(np.float64)  # lockstep: fp16 chunk, int4 chunk, ...
    np.testing.assert_allclose(np.concatenate(seen[0::2]), ref, atol=2e-4)  # the evaluator's reference side
    lp = ref - ref.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    lq = q - q.max(1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    kl = (np.exp(lp) * (lp - lq)).sum(1)[9:]  # predictions of tokens 10..299
    assert d.scored == 290
    assert d.mean_kld == pytest.approx(kl.mean(), rel=1e-3, abs=1e-7)
    assert d.p99_kld == pytest.approx(np.percentile(kl, 99), rel=1e-3)
    assert d.top1 == pytest.approx((lp.argmax(1) == lq.argmax(1))[9:].mean(), abs=1 / 290)
    t = np.asarray(ids[1:])
    assert d.ref_ppl == pytest.approx(math.exp(-lp[np.arange(299), t][9:].mean()), rel=1e-4)
    assert reports[1].perplexity.ppl == pytest.approx(d.ppl, rel=1e-9)
