"""``localctx eval --backend llamacpp``: perplexity through llama.cpp's own cache equals the
perplexity of llama.cpp's logits over the same tokens in one batch; a window streams through the
context shift and matches the full cache until its first shift; bytes are llama.cpp's; bad input
is one line and exit 2."""
import json
import math

import numpy as np
import pytest
from gguf_tiny import TinyGGUF, write

pytest.importorskip("llama_cpp")

from localctx.app.cli import main  # noqa: E402
from localctx.backends.evaluation.tasks import text_tokens  # noqa: E402
from localctx.backends.llamacpp.evaluate import LlamaCppTokenizer  # noqa: E402
from localctx.backends.models.ref import resolve  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # one KV head of 32 dims: a whole q8_0 / q4_0 block per head row
    cfg = TinyGGUF("llama", n_heads=2, n_kv_heads=1, head_dim=32)
    return write(tmp_path_factory.mktemp("evalcpp") / "llama.gguf", cfg, seed=3)


def one_batch_nll(path, ids: list[int], flash_attn: bool = False) -> np.ndarray:
    """-log p(token i | tokens < i) for i = 1.., from llama.cpp's logits of every position in one batch
    (``flash_attn`` as the evaluated cache ran: attention with and without it rounds differently)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=1024, n_batch=1024, n_ubatch=1024, logits_all=True, n_threads=1,
                flash_attn=flash_attn, verbose=False)
    try:
        llm.eval(ids)
        logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
    finally:
        llm.close()
    top = logits.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return log_z - logits[np.arange(len(ids) - 1), ids[1:]]


def run_eval(capsys, *argv) -> dict:
    assert main(["eval", "--backend", "llamacpp", "--threads", "1", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_streamed_perplexity_equals_one_batch_logits_token_by_token(tiny, capsys):
    data = run_eval(capsys, "-m", str(tiny), "--tokens", "200", "--chunk", "32", "--segment", "1", "--no-needle")
    assert data["backend"] == "llamacpp"
    row = data["policies"][0]
    assert row["policy"] == "fp16" and row["cache"]["type_k"] == "f16" and row["cache"]["type_v"] == "f16"
    ids = text_tokens(LlamaCppTokenizer(resolve(str(tiny))), 200)
    expected = one_batch_nll(tiny, ids)
    segs = row["perplexity"]["segments"]
    got = np.array([math.log(ppl) for a, b, ppl in segs])
    assert [s[0] for s in segs] == list(range(1, 200))
    # each token's log-prob, not only the mean: a shifted target or a stale logit row fails here
    assert np.abs(got - expected).max() < 2e-4
    assert row["perplexity"]["ppl"] == pytest.approx(math.exp(expected.mean()), rel=1e-5)
    # KV held: 199 tokens in the cache, 4 layers × (K + V) × 32 dims × 2 bytes (f16)
    assert row["perplexity"]["kv_tokens"] == 199
    assert row["perplexity"]["kv_bytes"] == 199 * 4 * 2 * 32 * 2
    assert row["cache"]["kv_alloc_bytes"] == 256 * 4 * 2 * 32 * 2  # 200 cells padded to 256


def test_quantized_rows_use_q8_0_and_q4_0_with_flash_attention_and_their_block_bytes(tiny, capsys):
    data = run_eval(capsys, "-m", str(tiny), "--tokens", "96", "--kv", "int8", "--kv", "int4", "--no-needle")
    rows = {r["policy"]: r for r in data["policies"]}
    assert [(r["cache"]["type_k"], r["cache"]["type_v"], r["cache"]["flash_attn"]) for r in rows.values()][1:] == \
        [("q8_0", "q8_0", True), ("q4_0", "q4_0", True)]
    per_row = {"int8": 34, "int4": 18}  # bytes per block of 32: one block per K or V row
    for name, block in per_row.items():
        assert rows[name]["perplexity"]["kv_bytes"] == 95 * 4 * 2 * block
    base = rows["fp16"]["perplexity"]["ppl"]
    assert rows["int8"]["perplexity"]["ppl"] != base  # a different cache, measured, not copied
    assert abs(rows["int8"]["perplexity"]["ppl"] / base - 1) < 0.02


def test_a_window_streams_through_the_context_shift_and_matches_the_full_cache_until_it_shifts(tiny, capsys):
    data = run_eval(capsys, "-m", str(tiny), "--tokens", "160", "--chunk", "16", "--segment", "1",
                    "--kv", "fp16+sink4+win64", "--no-needle")
    full, win = data["policies"]
    assert win["cache"]["n_ctx"] == 68 and win["cache"]["swa_full"]
    # the first shift happens before the batch of tokens 64..79 (64 + 16 > 68 cells)
    same = [a[2] for a in full["perplexity"]["segments"][:64]]
    assert same == [b[2] for b in win["perplexity"]["segments"][:64]]
    assert full["perplexity"]["segments"][70:] != win["perplexity"]["segments"][70:]
    assert win["perplexity"]["kv_tokens"] <= 68 < full["perplexity"]["kv_tokens"]


@pytest.mark.parametrize("argv,message", [
    (["--kv", "int4+sink4+win64"], "llama.cpp cannot run --kv int4+sink4+win64: its context shift"),
    (["--threads", "0"], "--threads 0 needs --backend llamacpp and at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(tiny, argv, message, capsys):
    assert main(["eval", "--backend", "llamacpp", "-m", str(tiny), "--tokens", "96", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_threads_with_the_torch_backend_is_refused(capsys):
    assert main(["eval", "--threads", "2", "--tokens", "96"]) == 2
    assert "--threads 2 needs --backend llamacpp" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_streamed_perplexity_equals_one_batch(capsys):
    data = run_eval(capsys, "--tokens", "256", "--chunk", "64", "--kv", "int8", "--needle-lengths", "256",
                    "--needle-depths", "0.5")
    full, q8 = data["policies"]
    ids = text_tokens(LlamaCppTokenizer(resolve(None)), 256)
    from localctx.backends.models.ref import bundled_default_path

    expected = math.exp(one_batch_nll(bundled_default_path(), ids, full["cache"]["flash_attn"]).mean())
    # fp16 runs with flash attention (backends/llamacpp/shift.flash_attn_for); with it the streamed 64-token
    # chunks and the one 256-token batch differ by 0.24% (17.214 against 17.255, measured 2026-12-06), where
    # without it they agreed within 0.1%: the batch shapes round differently, so 0.5% here
    assert full["perplexity"]["ppl"] == pytest.approx(expected, rel=5e-3)
    assert 1 < expected < 100  # a real model on English text
    assert abs(q8["perplexity"]["ppl"] / expected - 1) < 0.02
    assert full["needle"]["grid"][0]["hit"]  # the model finds a key 256 tokens back


def test_score_from_scores_only_the_later_predictions(tiny, capsys):
    data = run_eval(capsys, "-m", str(tiny), "--tokens", "200", "--chunk", "32", "--score-from", "150",
                    "--no-needle")
    ids = text_tokens(LlamaCppTokenizer(resolve(str(tiny))), 200)
    expected = one_batch_nll(tiny, ids)[149:]  # predictions of tokens 150..199
    ppl = data["policies"][0]["perplexity"]
    assert ppl["scored"] == 50 and ppl["ppl"] == pytest.approx(math.exp(expected.mean()), rel=1e-5)


# -- KL divergence from the full-precision cache ----------------------------------------------------
def test_two_full_precision_sessions_in_lockstep_diverge_by_exactly_zero(tiny):
    from localctx.backends.evaluation.tasks import PerplexityTask
    from localctx.backends.llamacpp.evaluate import LlamaCppEvaluator
    from localctx.kvcache.policy import KVPolicy

    ev = LlamaCppEvaluator(resolve(str(tiny)), threads=1)
    ids = text_tokens(ev.tokenizer, 150)
    sessions = [ev.session(KVPolicy(), 150), ev.session(KVPolicy(), 150)]
    try:
        (_, none), (_, same) = ev.lockstep(sessions, ids, PerplexityTask(150, 32))
    finally:
        for s in sessions:
            s.close()
    assert none is None
    assert same.mean_kld == 0.0 and same.p99_kld == 0.0 and same.top1 == 1.0 and same.scored == 149


def test_q4_0_kld_matches_numpy_against_one_batch_full_precision_logits(tiny, capsys, monkeypatch):
    from localctx.backends.llamacpp.evaluate import LlamaCppEvaluator

    seen = {}  # every session's logits per chunk, by policy (the sessions decode on worker threads)
    decode = LlamaCppEvaluator._decode

    def spy(session, batch, rows=None):
        out = decode(session, batch, rows)
        seen.setdefault(str(session.plan.policy), []).append(np.array(out, dtype=np.float64))
        return out

    monkeypatch.setattr(LlamaCppEvaluator, "_decode", staticmethod(spy))
    data = run_eval(capsys, "-m", str(tiny), "--tokens", "160", "--chunk", "32", "--kv", "int8", "--kv", "int4",
                    "--no-needle")
    rows = {r["policy"]: r for r in data["policies"]}
    assert rows["fp16"]["divergence"] is None  # the reference itself
    d8, d4 = rows["int8"]["divergence"], rows["int4"]["divergence"]
    assert 0 < d8["mean_kld"] < d4["mean_kld"]  # lossy, and q4_0 more than q8_0
    ids = text_tokens(LlamaCppTokenizer(resolve(str(tiny))), 160)
    ref = one_batch_logits(tiny, ids)
    q4 = np.concatenate(seen["int4"])
    lp = ref - ref.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    lq = q4 - q4.max(1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    kl = (np.exp(lp) * (lp - lq)).sum(1)
    assert d4["scored"] == 159
    assert d4["mean_kld"] == pytest.approx(kl.mean(), rel=2e-3, abs=1e-6)
    assert d4["p99_kld"] == pytest.approx(np.percentile(kl, 99), rel=2e-3, abs=1e-6)
    assert d4["top1"] == pytest.approx((lp.argmax(1) == lq.argmax(1)).mean(), abs=1 / 159)
    assert d4["ppl"] == pytest.approx(rows["int4"]["perplexity"]["ppl"], rel=1e-9)


def test_strided_scoring_on_parallel_sessions_equals_every_position_on_one_thread(tiny):
    """Scoring every 3rd prediction (logits only there), with two sessions decoding at once, gives the
    per-position figures of the one-thread every-position run at those positions."""
    from localctx.backends.evaluation.tasks import PerplexityTask
    from localctx.backends.llamacpp.evaluate import LlamaCppEvaluator
    from localctx.kvcache.policy import KVPolicy

    ev = LlamaCppEvaluator(resolve(str(tiny)), threads=1)
    ids = text_tokens(ev.tokenizer, 161)
    runs = {}
    for stride, workers in ((1, 1), (3, 2)):
        sessions = [ev.session(p, 161, threads=1) for p in (KVPolicy(), KVPolicy.parse("int4"))]
        try:  # segments of one token: every position's perplexity, exp(nll)
            task = PerplexityTask(161, 32, score_from=5, segment=1 if stride == 1 else 0, stride=stride)
            runs[stride] = ev.lockstep(sessions, ids, task, workers=workers)
        finally:
            for s in sessions:
                s.close()
    (full_ref, _), (full, d_full) = runs[1]
    (ref3, _), (q3, d3) = runs[3]
    picked = range(5, 161, 3)  # predictions of tokens 5..160
    assert d3.scored == len(picked) == q3.scored == ref3.scored and d_full.scored == 156
    for every, strided in ((full_ref, ref3), (full, q3)):
        by_position = {a: math.log(p) for a, _, p in every.segments}
        assert strided.ppl == pytest.approx(math.exp(sum(by_position[i] for i in picked) / len(picked)), rel=1e-4)
    assert d3.ref_ppl == pytest.approx(ref3.ppl, rel=1e-9) and d3.ppl == pytest.approx(q3.ppl, rel=1e-9)
    assert 0 < d3.mean_kld and 0 < d_full.mean_kld


def one_batch_logits(path, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=1024, n_batch=1024, n_ubatch=1024, logits_all=True, n_threads=1,
                verbose=False)
    try:
        llm.eval(ids)
        return np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
    finally:
        llm.close()
