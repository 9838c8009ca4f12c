"""Real K-quant GGUFs on mlx-lm's models (--backend mlx, graph mlx-lm): the bundled SmolLM2-135M
re-quantized with llama.cpp's own quantizer to Q4_K_M and Q6_K, and Gemma 3 270M's Q4_K_M, each
converted (gguf_convert.py) and decoded greedily on 3 prompts: the first token is llama.cpp's, and
each of the first few is one llama.cpp scores within ``TIE`` of its own best (MLX's affine
re-quantization rounds differently from the K-quants, so a near-tie may go the other way)."""
import ctypes

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX model zoo needs mlx-lm (pip install 'mlx-lm[cpu]' on Linux)")
llama_cpp = pytest.importorskip("llama_cpp", reason="the reference is llama.cpp (llama-cpp-python)")

from localctx.backends.mlx.backend import MLXBackend  # noqa: E402
from localctx.backends.mlx.lm_cache import LMCache, NativeCache  # noqa: E402
from localctx.backends.mlx.session import SessionOptions  # noqa: E402
from localctx.backends.models.ref import ModelRef  # noqa: E402
from localctx.backends.models.spec_reader import read_spec  # noqa: E402
from localctx.kvcache.plan import Plan  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

from test_mlx_zoo import greedy  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
AGREE = 4  # leading greedy tokens checked against llama.cpp's logits
TIE = 1.0  # logits: how far below llama.cpp's best a chosen token may score


def quantized_copy(source, folder, ftype: str):
    """``source`` written again as ``ftype`` (e.g. "Q4_K_M") by llama.cpp's own quantizer, into ``folder``."""
    out = folder / f"smollm2-{ftype.lower()}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


@pytest.fixture(scope="module", params=["Q4_K_M", "Q6_K"])
def smollm2_kquant(request, smollm2_path, tmp_path_factory):
    return quantized_copy(smollm2_path, tmp_path_factory.mktemp("kquant"), request.param)


def llamacpp_logits(llm, ids):
    """llama.cpp's logits after each of ``ids``."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def check_against_llamacpp(path, policy="fp16"):
    spec = read_spec(ModelRef("gguf", path, path.name, "file"))
    plan = Plan.fixed("mlx", spec, KVPolicy.parse(policy), 256)
    session = MLXBackend(SessionOptions(graph="mlx-lm")).load(ModelRef("gguf", path, path.name, "file"), plan)
    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False)
    for prompt in PROMPTS:
        ids = session.tokenizer.encode(prompt)
        session.reset()
        out = greedy(session, ids, AGREE)
        ref = llamacpp_logits(llm, ids + out)[len(ids) - 1:]
        assert out[0] == int(ref[0].argmax()), prompt
        assert all(row[tok] >= row.max() - TIE for row, tok in zip(ref, out)), (prompt, out)
    return session


@pytest.mark.slow
def test_a_smollm2_kquant_gguf_runs_on_mlx_lm_like_llamacpp(smollm2_kquant, capsys):
    session = check_against_llamacpp(smollm2_kquant)
    assert isinstance(session.cache, LMCache)
    assert "converted" in capsys.readouterr().err
    if "q4_k_m" in smollm2_kquant.name:
        check_against_llamacpp(smollm2_kquant, "int8")  # the second load uses the cached conversion
        assert "converted" not in capsys.readouterr().err


@pytest.mark.slow
def test_gemma3_q4_k_m_runs_on_mlx_lm_like_llamacpp(gemma3_path):
    session = check_against_llamacpp(gemma3_path)
    assert isinstance(session.cache, NativeCache)  # its sliding layers keep mlx-lm's own caches


@pytest.mark.slow
def test_the_bundled_q4_1_on_mlx_lm_gives_llamacpp_logits_on_a_chat(smollm2_path):
    """The bundled file itself (Q4_1, Q8_0 embeddings) through mlx-lm, on the chat prompt `localctx run
    "Name a color."` renders: every position's logits against llama.cpp's. Re-quantized by mx.quantize
    they correlated 0.80-0.95 and the answer was "A: A: A:"; on the file's own grid (gguf_grid.py) they
    agree to float16 rounding, and each greedy token is one llama.cpp scores within TIE of its best."""
    from localctx.backends.base import GenerationParams

    spec = read_spec(ModelRef("gguf", smollm2_path, smollm2_path.name, "file"))
    plan = Plan.fixed("mlx", spec, KVPolicy(), 256)
    ref = ModelRef("gguf", smollm2_path, smollm2_path.name, "file")
    session = MLXBackend(SessionOptions(graph="mlx-lm")).load(ref, plan)
    chat = [{"role": "user", "content": "Name a color."}]
    ids = session.tokenizer.encode(session.render(chat))
    got = np.array(session.model(mx.array(ids), session.model.make_cache(KVPolicy(), spec), last_only=False))
    llm = llama_cpp.Llama(str(smollm2_path), n_ctx=256, logits_all=True, verbose=False)
    want = llamacpp_logits(llm, ids)
    assert all(np.corrcoef(g, w)[0, 1] >= 0.995 for g, w in zip(got, want))
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()
    session.reset()
    events = list(session.generate(chat, GenerationParams(max_tokens=8, temperature=0.0)))
    tokens = [e.token for e in events if e.kind == "token"]
    ref = llamacpp_logits(llm, ids + tokens)[len(ids) - 1:]  # llama.cpp's scores for each greedy step
    assert tokens[0] == int(ref[0].argmax()) and tokens[:2] != [49, 42]  # not "A:"
    assert all(row[tok] >= row.max() - TIE for row, tok in zip(ref, tokens)), tokens
