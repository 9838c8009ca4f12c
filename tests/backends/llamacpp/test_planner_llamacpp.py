"""The plan on llama.cpp: n_ctx / type_k / type_v / flash_attn, refusals, and sinks + window through
llama.cpp's context shift (a session streams past n_ctx)."""
import json

import pytest

from localctx.backends.llamacpp import shift
from localctx.kvcache.calibration import Calibration, FormatCost
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy

SMOL = known_spec("smollm2-135m")


def plan_for(text: str, context: int | None = None) -> Plan:
    return Plan.fixed("llamacpp", SMOL, KVPolicy.parse(text), context)


def calibration(fp16_flash_attn: bool) -> Calibration:
    return Calibration(backend="llamacpp", hardware_key="x", model="m", weight_bytes=1, bandwidth_bytes_s=1,
                       formats={"fp16": FormatCost(0.01, 1e-10, settings={"flash_attn": fp16_flash_attn})})


def test_exact_plans_map_to_n_ctx_and_llama_cpp_kv_types():
    s = shift.settings_for(plan_for("fp16", 8192))
    # fp16 with reuse not known to stay exact with flash attention opens as llama-cpp-python does, without it
    assert (s.n_ctx, s.type_k, s.type_v, s.flash_attn, s.window) == (8192, "f16", "f16", False, None)
    assert not shift.settings_for(plan_for("fp16"), calibration(True)).flash_attn  # faster, but not exact here
    # where the reuse probe found it exact (reuse_probe.py): on, unless the calibration measured it slower
    assert shift.settings_for(plan_for("fp16"), None, reuse_exact=True).flash_attn
    assert shift.settings_for(plan_for("fp16"), calibration(True), reuse_exact=True).flash_attn
    assert not shift.settings_for(plan_for("fp16"), calibration(False), reuse_exact=True).flash_attn
    q8 = shift.settings_for(plan_for("int8", 4096), calibration(False))
    assert (q8.n_ctx, q8.type_k, q8.type_v, q8.flash_attn) == (4096, "q8_0", "q8_0", True)  # quantized V needs FA
    assert shift.settings_for(plan_for("int4")).type_v == "q4_0"


def test_windowed_plans_hold_sinks_plus_window_and_shift_in_chunks():
    s = shift.settings_for(plan_for("fp16+sink4+win4096", 16384))
    assert (s.n_ctx, s.sinks, s.window, s.shift_chunk) == (4100, 4, 4096, 256)
    assert shift.settings_for(plan_for("fp16+sink4+win256")).shift_chunk == 16


def test_what_llama_cpp_cannot_do_is_refused_with_the_reason():
    from localctx.backends.llamacpp.backend import LlamaCppBackend

    backend = LlamaCppBackend()
    assert backend.refusals(KVPolicy.parse("fp16+sink4+win4096"), SMOL) == []
    assert backend.refusals(KVPolicy.parse("int8"), SMOL) == []
    shifted_q = backend.refusals(KVPolicy.parse("int8+sink4+win1024"), SMOL)
    assert len(shifted_q) == 1 and "requantise the quantized K cache" in shifted_q[0]
    assert "trained context" in backend.refusals(KVPolicy.parse("fp16+sink4+win9000"), SMOL)[0]
    assert "residual" in backend.refusals(KVPolicy.parse("int4+res128"), SMOL)[0]
    assert "heavy" in backend.refusals(KVPolicy.parse("fp16+sink4+win512+heavy64"), SMOL)[0]


def _long_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics.values())


@pytest.fixture(scope="module")
def windowed(smollm2_path):
    from localctx.backends.llamacpp.backend import LlamaCppBackend
    from localctx.backends.models.ref import resolve

    session = LlamaCppBackend().load(resolve(str(smollm2_path)), plan_for("fp16+sink4+win256", 100_000))
    yield session
    session.close()


@pytest.mark.slow
def test_a_windowed_session_streams_past_n_ctx(windowed):
    from localctx.backends.base import GenerationParams

    windowed.reset()
    prompt = windowed.llm.detokenize(windowed.llm.tokenize(_long_text().encode())[:600]).decode(errors="ignore")
    n_prompt = windowed.count_tokens(prompt)
    assert n_prompt > windowed.settings.n_ctx  # plain llama.cpp would refuse this prompt
    events = list(windowed.generate(prompt, GenerationParams(max_tokens=24)))
    done = events[-1]
    assert done.kind == "done" and done.finish_reason == "length"
    stats = done.stats
    assert stats.generated_tokens == 24
    assert stats.kv_tokens <= windowed.settings.n_ctx
    assert stats.kv_tokens + stats.evicted_tokens == n_prompt + 23  # the last token is sampled, not yet cached
    assert stats.kv_bytes == stats.kv_tokens * 23_040  # fp16 KV, 23,040 bytes per token
    assert "".join(e.text for e in events).strip()


@pytest.mark.slow
def test_after_a_shift_the_cache_equals_a_fresh_evaluation_of_the_kept_tokens(windowed, smollm2_path):
    """Sinks + window semantics: the shifted cache holds the first 4 tokens and the most recent ones at
    positions 0..n-1. A fresh context fed exactly those tokens predicts the same next token (not the same
    logits: the kept tokens' deeper-layer K/V were computed while the evicted tokens were still there)."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    windowed.reset()
    ids = windowed.llm.tokenize(_long_text().encode())[:700]
    windowed._shift.feed(ids)
    assert windowed._shift.evicted > 0
    kept = [int(t) for t in windowed.llm.input_ids[: windowed.llm.n_tokens]]
    assert kept[:4] == ids[:4] and kept[4:] == ids[len(ids) - len(kept) + 4:]
    n_vocab = windowed.llm.n_vocab()
    shifted = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(windowed.llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
    fresh_llm = Llama(model_path=str(smollm2_path), n_ctx=300, n_threads=windowed.llm.n_threads, verbose=False)
    fresh_llm.eval(kept)
    fresh = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(fresh_llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
    fresh_llm.close()
    assert int(np.argmax(shifted)) == int(np.argmax(fresh))
    assert len(set(np.argsort(shifted)[-5:]) & set(np.argsort(fresh)[-5:])) >= 4
    mem = llama_cpp.llama_get_memory(windowed.llm._ctx.ctx)
    assert llama_cpp.llama_memory_seq_pos_min(mem, 0) == 0
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == windowed.llm.n_tokens - 1 < windowed.settings.n_ctx


@pytest.mark.slow
def test_a_chat_keeps_its_cache_across_turns_after_eviction(windowed):
    from localctx.backends.base import GenerationParams

    windowed.reset()
    long_user = windowed.llm.detokenize(windowed.llm.tokenize(_long_text().encode())[:400]).decode(errors="ignore")
    turn1 = [{"role": "user", "content": long_user}]
    reply = "".join(e.text for e in windowed.generate(turn1, GenerationParams(max_tokens=8)))
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter, please."}]
    done = list(windowed.generate(turn2, GenerationParams(max_tokens=4)))[-1]
    assert done.stats.evicted_tokens > 0
    assert done.stats.cached_tokens > 400  # only the new turn was fed, not the whole conversation again


@pytest.mark.slow
def test_run_past_the_trained_context_plans_a_window_on_llama_cpp(cli):
    result = cli("run", "--backend", "llamacpp", "--context", "16384", "--max-tokens", "4", "--json", "Say hi.")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["policy"] == "fp16+sink4+win4092" and out["exact"] is False
