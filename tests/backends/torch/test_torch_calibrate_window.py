"""``plan --calibrate-quality`` on the torch backend (backends/evaluation/calibrate_quality.py), on a tiny
random-weight GGUF: besides every format, it measures the window the planner takes here, cut to half
the text, scored only at the positions past sinks + window, and its figure equals the evaluator's own
lockstep scored from there (inside the window a full-precision window diverges by rounding only)."""
import pytest

from localctx.backends.evaluation import calibrate_quality
from localctx.backends.evaluation.tasks import PerplexityTask, text_tokens
from localctx.backends.models.ref import ModelRef
from localctx.backends.models.spec_reader import read_spec
from localctx.backends.torch.evaluate import PolicyEvaluator
from localctx.backends.torch.loading import TorchOptions, load_model
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = TinyConfig(head_dim=32, hidden=64, context=1024)
    return ModelRef("gguf", write_gguf(tmp_path_factory.mktemp("calw") / "t.gguf", cfg, tiny_weights(cfg, seed=6)),
                    "tiny", "file")


def test_the_planned_window_is_measured_past_it_on_torch(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    spec = read_spec(tiny)
    window = calibrate_quality.window_for("torch", spec, tiny, tokens=512)
    assert window == KVPolicy.parse("fp16+sink4+win256")  # half of 512; the default cap (508) is wider
    cal = calibrate_quality.calibrate("torch", tiny, spec, window, tokens=512)
    assert set(cal.figures) == {"int8", "k8v4", "kf16v4", "int4+res128", "int4"}
    w = cal.windows["fp16+sink4+win256"]
    assert (w["score_from"], w["tokens"]) == (261, 252)  # predictions of tokens 261..512, nothing earlier
    assert w["mean_kld"] > 0 and "252 positions from 261 to 512" in cal.note
    loaded = load_model(tiny, TorchOptions.from_env())
    ev = PolicyEvaluator(loaded.model, loaded.tokenizer)
    ids = text_tokens(ev.tokenizer, 513)
    (_, _), (_, past) = ev.lockstep([KVPolicy(), window], ids, PerplexityTask(513, 256, score_from=261))
    assert past.scored == 252 and w["mean_kld"] == pytest.approx(past.mean_kld, rel=1e-9)
    (_, _), (_, inside) = ev.lockstep([KVPolicy(), window], ids, PerplexityTask(261, 256))
    assert inside.mean_kld < 1e-12 < past.mean_kld and inside.top1 == 1.0  # rounding only, inside the window
