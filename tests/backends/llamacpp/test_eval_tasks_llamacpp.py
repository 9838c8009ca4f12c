"""``localctx eval --backend llamacpp --tasks``: on a tiny GGUF each policy answers every sample of
the long-context tasks, the full-precision answers are llama.cpp's own greedy continuation of the
same prompt ids, and the scores are the answers' exact matches; on the bundled SmolLM2 the
multi-key needle is found at 512 tokens."""
import json

import numpy as np
import pytest
from gguf_tiny import TinyGGUF, write

pytest.importorskip("llama_cpp")

from localctx.app.cli import main  # noqa: E402
from localctx.backends.evaluation import long_tasks  # noqa: E402
from localctx.backends.llamacpp.evaluate import LlamaCppTokenizer  # noqa: E402
from localctx.backends.models.ref import resolve  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = TinyGGUF("llama", n_heads=2, n_kv_heads=1, head_dim=32)  # one q8_0 / q4_0 block per head row
    return write(tmp_path_factory.mktemp("evaltasks") / "llama.gguf", cfg, seed=5)


def run_eval(capsys, *argv) -> dict:
    assert main(["eval", "--backend", "llamacpp", "--threads", "1", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def plain_greedy(path, ids: list[int], n: int) -> list[int]:
    """llama.cpp's own greedy continuation: the prompt in one batch, then one token at a time."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=2048, n_batch=2048, n_ubatch=2048, logits_all=True, n_threads=1,
                verbose=False)
    try:
        llm.eval(ids)
        out = []
        for _ in range(n):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        return out
    finally:
        llm.close()


def test_each_policy_answers_every_sample_and_full_precision_answers_as_llamacpp_does(tiny, capsys):
    data = run_eval(capsys, "-m", str(tiny), "--tasks", "niah_multikey,vt", "--lengths", "1024,1536", "--samples", "2",
                    "--chunk", "64", "--no-perplexity", "--no-needle", "--kv", "int8")
    assert data["tasks_suite"]["tasks"] == ["niah_multikey", "vt"] and data["tasks_suite"]["samples"] == 2
    full, q8 = data["tasks"]
    assert (full["policy"], q8["policy"]) == ("fp16", "int8")
    assert [(s["task"], s["length"], s["samples"]) for s in full["summary"]] == [
        ("niah_multikey", 1024, 2), ("niah_multikey", 1536, 2), ("vt", 1024, 2), ("vt", 1536, 2)]
    tok = LlamaCppTokenizer(resolve(str(tiny)))
    samples = list(long_tasks.samples(tok, long_tasks.TaskSuite(("niah_multikey", "vt"), (1024, 1536), samples=2)))
    assert len(full["samples"]) == len(q8["samples"]) == len(samples) == 8
    for row, s in zip(full["samples"], samples):
        assert row["expected"] == list(s.expected) and row["tokens"] == len(s.ids) <= s.length
        assert row["score"] == long_tasks.score(row["answer"], s.expected)
    # the streamed prompt and the greedy steps are llama.cpp's own continuation of the same ids
    s = samples[0]
    assert full["samples"][0]["answer"] == tok.decode(plain_greedy(tiny, s.ids, s.answer_tokens))


@pytest.mark.slow
def test_smollm2_finds_the_multikey_needle_at_512_tokens(capsys):
    data = run_eval(capsys, "--tasks", "niah_multikey", "--lengths", "512", "--no-perplexity", "--no-needle")
    (full,) = data["tasks"]
    assert full["summary"] == [{"task": "niah_multikey", "length": 512, "samples": 1, "hits": 1, "score": 1.0}]
