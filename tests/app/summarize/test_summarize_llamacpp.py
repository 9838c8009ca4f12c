"""llama.cpp multi-sequence batching and an end-to-end summarize run on the real SmolLM2 model."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from localctx.app import cli  # noqa: E402
from localctx.app.session_options import SessionRequest, open_session  # noqa: E402
from localctx.backends.base import GenerationParams  # noqa: E402
from localctx.kvcache.errors import UserError  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def session():
    try:
        s = open_session(SessionRequest(model=None, backend="llamacpp", context=512))
    except UserError as exc:
        pytest.skip(f"bundled SmolLM2 not available: {exc}")
    yield s
    s.close()


def single_logits(session, tokens):
    import llama_cpp
    session.reset()
    session.llm.eval(tokens)
    row = llama_cpp.llama_get_logits_ith(session.llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(session.llm.n_vocab(),)).copy()


# llama.cpp's arithmetic depends on the batch's shape and the KV cells' layout (most positions match
# bit for bit, some differ by ~2% of the logit range), so compare with a tolerance and top-k overlap;
# a wrong position or sequence id would change the ranking altogether.
@pytest.mark.parametrize("n_batch", [512, 8])  # whole prompts per slice, and prompts cut across slices
def test_batched_logits_match_one_sequence_at_a_time(session, n_batch, tolerance=5e-2):
    from localctx.backends.llamacpp.batch import BatchDecoder, DecodeSequence, sampler_chain
    prompts = ["The capital of France is", "Colours of the rainbow: red, orange,", "def fib(n):\n    return"]
    ids = [session.tokenize(p) for p in prompts]
    assert len({len(t) for t in ids}) == 3  # different lengths: positions must be per sequence
    decoder = BatchDecoder(session.llm, 256, len(ids), n_batch=n_batch)
    decoder.captured = []
    params = GenerationParams(max_tokens=4)
    for k, tokens in enumerate(ids):
        decoder.seqs.append(DecodeSequence(index=k, seq_id=k, prompt=tokens, sampler=sampler_chain(params, decoder.model)))
    gens = [decoder.tokens(seq) for seq in decoder.seqs]
    try:
        produced = [[next(g)] for g in gens]
        for g, out in zip(gens, produced):
            out.append(next(g))
        captured = list(decoder.captured)
    finally:
        for g in gens:
            g.close()
        decoder.close()
    per_seq: dict[int, list] = {}
    for index, logits in captured:
        per_seq.setdefault(index, []).append(logits)
    for k, tokens in enumerate(ids):
        for step in range(2):  # after the prompt, and after one decoded token
            ref = single_logits(session, tokens + produced[k][:step])
            got = per_seq[k][step]
            assert np.max(np.abs(ref - got)) <= tolerance * np.max(np.abs(ref))
            assert len(set(np.argsort(-ref)[:10]) & set(np.argsort(-got)[:10])) >= 8
            assert int(np.argmax(got)) == produced[k][step]


def test_generate_batch_streams_every_prompt_to_done(session):
    prompts = [[{"role": "user", "content": q}] for q in ("Say hi.", "Count: one, two,", "Name a fruit.")]
    params = GenerationParams(max_tokens=6, stop=("\n\n",))
    texts, done = ["", "", ""], {}
    for index, event in session.generate_batch(prompts, params):
        texts[index] += event.text
        if event.kind == "done":
            assert index not in done
            done[index] = event
    assert sorted(done) == [0, 1, 2]
    for index, event in done.items():
        assert 1 <= event.stats.generated_tokens <= 6
        assert event.stats.prompt_tokens == session.count_tokens(prompts[index])
        assert event.finish_reason in ("stop", "length")
        assert texts[index].strip()


def test_summarize_end_to_end_with_smollm2(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "cache.md").write_text("# KV cache\n\nThe KV cache stores keys and values of past tokens so that "
                                   "decoding does not recompute them. It grows with the context length.\n")
    (docs / "sinks.txt").write_text("Attention sinks are the first tokens of a sequence. Keeping them while "
                                    "evicting the middle lets a model stream past its trained length.\n")
    (docs / "quant.txt").write_text("Quantizing the KV cache to 8 or 4 bits cuts its memory by half or three "
                                    "quarters, at a small cost in accuracy.\n")
    code = cli.main(["summarize", str(docs), "--out", str(tmp_path / "out"), "--backend", "llamacpp",
                     "--context", "1024", "--summary-tokens", "24", "--json"])
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    report = json.loads((tmp_path / "out" / "summarize-report.json").read_text())
    assert report["counts"]["done"] == 3 and report["backend"] == "llamacpp"
    assert report["totals"]["widest_batch"] == 3  # the three documents decoded together
    for name in ("cache.md", "sinks.txt", "quant.txt"):
        assert (tmp_path / "out" / f"{name}.summary.md").read_text().strip()
    assert events[-1]["event"] == "done"
