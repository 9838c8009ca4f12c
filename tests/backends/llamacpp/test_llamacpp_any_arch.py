"""The llama.cpp backend runs any architecture llama.cpp loads, sized and refused by what llama.cpp
can do for it: sliding layers in a compact SWA cache (and a prefix it dropped is not reused),
windowed plans with the full-size cache a context shift needs, recurrent layers that cannot shift."""
import pytest
from gguf_tiny import ARCHS, write

pytest.importorskip("llama_cpp")

from localctx.backends.base import GenerationParams  # noqa: E402
from localctx.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from localctx.backends.llamacpp.shift import refusals, settings_for_policy  # noqa: E402
from localctx.backends.llamacpp.session import default_threads  # noqa: E402
from localctx.backends.models.spec_reader import gguf_spec  # noqa: E402
from localctx.backends.models.ref import resolve  # noqa: E402
from localctx.kvcache.plan import Plan  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402
from localctx.kvcache.model_spec import NONE, LayerAttention, ModelSpec  # noqa: E402


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return write(tmp_path_factory.mktemp("g3") / "gemma3.gguf", ARCHS["gemma3"])


def session_for(path, policy: str, context: int):
    spec = gguf_spec(path)
    return LlamaCppBackend().load(resolve(str(path)), Plan.fixed("llamacpp", spec, KVPolicy.parse(policy), context))


def test_exact_plans_take_the_compact_swa_cache_and_windowed_plans_the_full_one():
    assert settings_for_policy(KVPolicy(), 8192).swa_full is False
    assert settings_for_policy(KVPolicy.parse("fp16+sink4+win1024"), 8192).swa_full is True


def test_recurrent_layers_refuse_a_window_with_the_reason():
    spec = ModelSpec("m", "mamba", 2, 4, 0, 16, 64, 100, 4096, layers=(LayerAttention(NONE), LayerAttention(NONE)))
    assert refusals(KVPolicy()) == []
    reasons = refusals(KVPolicy.parse("fp16+sink4+win256"), spec)
    assert len(reasons) == 1 and "recurrent layers" in reasons[0] and "cannot shift" in reasons[0]


def test_a_prefix_older_than_the_window_is_not_reused_from_a_compact_swa_cache(gemma3):
    session = session_for(gemma3, "fp16", 4096)
    try:
        assert session.decode_threads == default_threads()  # every physical core decodes
        assert session.settings.swa_full is False and session._n_swa == 512
        long = ("the " * 800).strip()
        list(session.generate(long, GenerationParams(max_tokens=2)))
        ids = session.tokenize(long)
        assert len(ids) > 1024  # past the SWA cache's 1,024 cells: its oldest cells were reused
        # the same stream extended: the whole cache is reused
        assert session._cached_prefix(ids + [5, 6]) == len(ids)
        # a prompt that shares only its first 50 tokens: the sliding layers no longer hold what
        # position 50 needs (their cells start past it), so the cache is cleared, not reused
        assert session._cached_prefix(ids[:50] + [7] * 10) == 0
        assert int(session.llm.n_tokens) == 0
    finally:
        session.close()


def test_a_windowed_plan_streams_past_n_ctx_on_a_sliding_window_model(gemma3):
    session = session_for(gemma3, "fp16+sink4+win252", 4096)
    try:
        assert session.settings.swa_full is True and session.settings.n_ctx == 256
        events = list(session.generate(("a b " * 200).strip(), GenerationParams(max_tokens=4)))
        assert events[-1].kind == "done" and events[-1].stats.evicted_tokens > 0
    finally:
        session.close()
