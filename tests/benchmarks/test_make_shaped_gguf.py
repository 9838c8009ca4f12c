"""benchmarks/tools/make_shaped_gguf.py writes a GGUF that has the shape it names, in llama.cpp's
Q4_K_M, which the planner's reader reads back and llama.cpp loads and runs."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "make_shaped_gguf.py"


def _tool():
    spec = importlib.util.spec_from_file_location("make_shaped_gguf", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_written_file_has_the_named_shape_and_runs(tmp_path):
    tool = _tool()
    shape = tool.Shape("tiny", layers=2, embd=256, ffn=512, heads=4, kv_heads=2, vocab=49_152 + 64,
                       context=4096)
    out = tool.make(shape, tmp_path / "tiny.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # no intermediate left behind

    from localctx.backends.models.spec_reader import gguf_spec

    spec = gguf_spec(out)
    assert (spec.architecture, spec.n_layers, spec.hidden_size, spec.n_heads, spec.n_kv_heads) == \
        ("qwen2", 2, 256, 4, 2)
    assert (spec.head_dim, spec.vocab_size, spec.context_length, spec.intermediate_size) == (64, 49_216, 4096, 512)
    # every matrix of a 256-wide model is K-quantized (ggml type 12 is Q4_K, 14 Q6_K); norms and biases stay F32
    from localctx.backends.models.gguf_header import read_header

    types = {t.name: t.ggml_type for t in read_header(out).tensors}
    assert types["blk.0.ffn_gate.weight"] in (12, 14) and types["blk.0.attn_norm.weight"] == 0
    assert types["blk.1.attn_q.bias"] == 0

    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, n_threads=1, verbose=False)
    try:
        assert llm.n_vocab() == 49_216
        result = llm("hello", max_tokens=3, temperature=0.0)
        assert result["usage"]["prompt_tokens"] > 0
    finally:
        llm.close()
