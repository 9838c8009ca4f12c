"""``plan --calibrate-quality --backend mlx`` (backends/evaluation/calibrate_quality.py) on a tiny
random-weight model: every lossy format the MLX backend offers is measured on the graph ``localctx run``
takes for it, and each figure equals a NumPy KL divergence over the logits of two sessions loaded as
``run`` loads them; a full-precision cache diverges by exactly 0; the window is scored only past it;
the planner then judges MLX plans by this calibration and no other backend's."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends.evaluation import calibrate_quality  # noqa: E402
from localctx.backends.evaluation.tasks import PerplexityTask, text_tokens  # noqa: E402
from localctx.backends.machine.planner_inputs import kld_table  # noqa: E402
from localctx.backends.mlx.backend import MLXBackend  # noqa: E402
from localctx.backends.mlx.evaluate import MLXEvaluator, evaluate  # noqa: E402
from localctx.backends.mlx.session import SessionOptions  # noqa: E402
from localctx.backends.models.ref import ModelRef  # noqa: E402
from localctx.backends.models.spec_reader import hf_spec  # noqa: E402
from localctx.kvcache import quality_calibration  # noqa: E402
from localctx.kvcache.plan import Plan  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

from test_mlx_backend import TINY, write_tiny_folder  # noqa: E402

N = 256  # predictions scored: N + 1 tokens of text
WINDOW = KVPolicy.parse("fp16+sink4+win96")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = write_tiny_folder(tmp_path_factory.mktemp("calq") / "model", {**TINY, "max_position_embeddings": 4096})
    return ModelRef("hf", folder, "tiny", "folder")


@pytest.fixture(scope="module")
def cal(tiny, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALCTX_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield calibrate_quality.calibrate("mlx", tiny, hf_spec(tiny.path), WINDOW, tokens=N)
    mp.undo()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def run_logits(ref: ModelRef, policy: str, ids: list[int]) -> np.ndarray:
    """Every position's logits from a session loaded as ``localctx run --backend mlx`` loads one."""
    spec = hf_spec(ref.path)
    session = MLXBackend(SessionOptions(prefill_chunk=calibrate_quality.CHUNK)).load(
        ref, Plan.fixed("mlx", spec, KVPolicy.parse(policy), len(ids)))
    return np.asarray(session.feed(ids, all_logits=True), dtype=np.float64)


def test_every_lossy_format_equals_a_numpy_kl_over_runs_own_sessions(tiny, cal):
    spec = hf_spec(tiny.path)
    assert set(cal.figures) == {"int8", "int4+res128", "int4"}  # mixed K/V widths: refused by MLX
    assert set(cal.figures) == {calibrate_quality.format_key(p) for p in calibrate_quality.formats_for("mlx", spec)}
    assert cal.backend == "mlx" and cal.command.endswith("--backend mlx")
    ev = MLXEvaluator(tiny, graph="auto")
    assert {ev.graph_of(p) for p in calibrate_quality.formats_for("mlx", spec)} == {"mlx-lm"}  # as run takes them
    ids = text_tokens(ev.tokenizer, N + 1)[:N + 1]
    reference = log_softmax(run_logits(tiny, "fp16", ids[:-1]))
    for fmt in ("int8", "int4"):
        lossy = log_softmax(run_logits(tiny, fmt, ids[:-1]))
        kl = (np.exp(reference) * (reference - lossy)).sum(1)
        f = cal.figures[fmt]
        assert f["tokens"] == N and f["mean_kld"] > 0
        assert f["mean_kld"] == pytest.approx(kl.mean(), rel=1e-5), fmt
        assert f["top1"] == pytest.approx((reference.argmax(1) == lossy.argmax(1)).mean())
    assert cal.figures["int8"]["mean_kld"] < cal.figures["int4"]["mean_kld"]


def test_a_full_precision_cache_diverges_by_exactly_zero_on_the_calibrations_graph(tiny):
    ev = MLXEvaluator(tiny, chunk=calibrate_quality.CHUNK, graph="auto")
    assert ev.graph_of(KVPolicy()) == "mlx-lm"
    sessions = [ev.session(KVPolicy(), N + 1), ev.session(KVPolicy(), N + 1)]
    ids = text_tokens(ev.tokenizer, N + 1)
    (_, none), (_, same) = ev.lockstep(sessions, ids, PerplexityTask(N + 1, calibrate_quality.CHUNK))
    assert none is None
    assert same.scored == N and same.mean_kld == 0.0 and same.p99_kld == 0.0 and same.top1 == 1.0


def test_the_window_is_scored_only_past_it_and_equals_the_evaluators_figure(tiny, cal):
    w = cal.windows[str(WINDOW)]
    assert (w["score_from"], w["tokens"]) == (WINDOW.capacity() + 1, N - WINDOW.capacity())
    ev = MLXEvaluator(tiny, chunk=calibrate_quality.CHUNK, graph="auto")
    past = evaluate(ev, [WINDOW], PerplexityTask(N + 1, calibrate_quality.CHUNK, score_from=w["score_from"]),
                    None)[1].divergence
    assert past.scored == w["tokens"] and w["mean_kld"] == pytest.approx(past.mean_kld, rel=1e-9)
    inside = evaluate(ev, [WINDOW], PerplexityTask(WINDOW.capacity() + 1, calibrate_quality.CHUNK), None)[1].divergence
    assert inside.mean_kld < 1e-9 < past.mean_kld  # nothing evicted inside the window


def test_the_planner_judges_mlx_plans_by_the_mlx_calibration_only(tiny, cal, monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    spec = hf_spec(tiny.path)
    assert not kld_table("mlx", spec, tiny.path)[0].measured
    quality_calibration.save(cal, tiny.path)
    measured = kld_table("mlx", spec, tiny.path)[0].measured
    assert {fmt: f.mean_kld for fmt, f in measured.items()} == {fmt: f["mean_kld"] for fmt, f in cal.figures.items()}
    assert all(f.basis == "measured" for f in measured.values())
    assert not kld_table("llamacpp", spec, tiny.path)[0].measured  # another backend's cache loses differently
    assert not kld_table("torch", spec, tiny.path)[0].measured
