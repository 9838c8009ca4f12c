"""``localctx eval --tasks`` on the torch backend: on a tiny random-weight model every policy answers
every sample, the full-precision answer is the model's greedy continuation without any cache
(the reference forward of tests/torch_tiny_models.py), and scores are the answers' exact matches."""
import json

import pytest
import torch
from torch_tiny_models import TinyConfig, greedy_without_cache, tiny_weights, write_gguf

from localctx.app.cli import main
from localctx.backends.evaluation import long_tasks
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, load_model

CFG = TinyConfig(n_layers=2, hidden=64, n_heads=2, n_kv_heads=1, head_dim=32, intermediate=96, context=4096)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    weights = tiny_weights(CFG, seed=7)
    return write_gguf(tmp_path_factory.mktemp("evaltasks") / "tiny.gguf", CFG, weights), weights


@pytest.mark.slow  # about a minute on a loaded 2-core machine
def test_each_policy_answers_every_sample_and_full_precision_answers_as_the_uncached_model(tiny, capsys, monkeypatch):
    path, weights = tiny
    monkeypatch.setenv("LOCALCTX_TORCH_DEVICE", "cpu")
    assert main(["eval", "-m", str(path), "--tasks", "niah_multikey,cwe", "--lengths", "768", "--chunk", "64",
                 "--no-perplexity", "--no-needle", "--kv", "int4", "--kv", "fp16+sink4+win256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in data["tasks"]] == ["fp16", "int4", "fp16+sink4+win256"]
    tokenizer = load_model(ModelRef("gguf", path, "tiny", "file"), TorchOptions(device="cpu", dtype=torch.float32)).tokenizer
    samples = list(long_tasks.samples(tokenizer, long_tasks.TaskSuite(("niah_multikey", "cwe"), (768,))))
    for report in data["tasks"]:
        assert [s["task"] for s in report["summary"]] == ["niah_multikey", "cwe"]
        for row, s in zip(report["samples"], samples, strict=True):
            assert row["tokens"] == len(s.ids) <= 768 and row["expected"] == list(s.expected)
            assert row["score"] == long_tasks.score(row["answer"], s.expected)
    s = samples[0]
    with torch.no_grad():
        reference = tokenizer.decode(greedy_without_cache(CFG, weights, s.ids, s.answer_tokens))
    assert data["tasks"][0]["samples"][0]["answer"] == reference
