"""``localctx eval --backend mlx --tasks``: on a tiny random-weight folder every policy answers every
sample, the full-precision answer equals the greedy continuation computed with the whole sequence in
one forward per token, and scores are the answers' exact matches; the perplexity streams through it."""
import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.app.cli import main  # noqa: E402
from localctx.backends.evaluation import long_tasks  # noqa: E402
from localctx.backends.mlx.evaluate import MLXEvaluator  # noqa: E402
from localctx.backends.models.ref import ModelRef  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

from test_mlx_backend import TINY, VOCAB, write_tiny_folder  # noqa: E402


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("evaltasks") / "model", TINY)


@pytest.mark.slow  # about a minute and a half on a loaded 2-core machine
def test_each_policy_answers_every_sample_and_full_precision_answers_as_one_forward_per_token(tiny_folder, capsys):
    assert main(["eval", "--backend", "mlx", "-m", str(tiny_folder), "--tasks", "niah_multikey,vt", "--lengths",
                 "1024", "--chunk", "128", "--tokens", "96", "--no-needle", "--kv", "int8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] == "mlx" and [r["policy"] for r in data["tasks"]] == ["fp16", "int8"]
    full, q8 = (r["perplexity"] for r in data["policies"])
    assert full["scored"] == q8["scored"] == 95 and full["kv_tokens"] == 95 and q8["kv_bytes"] < full["kv_bytes"]
    assert 1 < full["ppl"] < 10 * VOCAB and abs(q8["ppl"] / full["ppl"] - 1) < 0.05
    ev = MLXEvaluator(ModelRef("hf", tiny_folder, "tiny", "folder"))
    samples = list(long_tasks.samples(ev.tokenizer, long_tasks.TaskSuite(("niah_multikey", "vt"), (1024,))))
    for report in data["tasks"]:
        for row, s in zip(report["samples"], samples, strict=True):
            assert row["tokens"] == len(s.ids) <= 1024 and row["expected"] == list(s.expected)
            assert row["score"] == long_tasks.score(row["answer"], s.expected)
    s, out = samples[0], []
    for _ in range(s.answer_tokens):
        seq = s.ids + out
        session = ev.session(KVPolicy(), len(seq), chunk=len(seq))
        out.append(int(np.asarray(session.feed(seq)).reshape(-1).argmax()))
    assert data["tasks"][0]["samples"][0]["answer"] == ev.decode(out)
