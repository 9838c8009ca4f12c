"""A forward that fails part way through the layers leaves no trace in the KV cache: every layer
is back to its state before the step (held tokens, quantized groups, attention mass, the pool),
and the generation that follows is the one a session that never failed produces."""
from __future__ import annotations

import pytest
import torch

from localctx.backends.base import GenerationParams
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache import eviction
from localctx.kvcache.paged import PagedKVCache
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

CFG = TinyConfig(n_layers=3, hidden=64, n_heads=2, n_kv_heads=1, head_dim=32)  # quantized KV: groups of 32 channels
OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8, prefill_chunk=16)
PROMPT = [(7 * i + 3) % 200 + 1 for i in range(56)]
STEPS = 24  # 80 tokens: every policy below but fp16 has quantized groups, evicted tokens, or both, by then
POLICIES = ["fp16", "fp16+sink2+win12", "fp16+sink2+win12+heavy4", "int8+res8", "int8+sink2+win40",
            "int4+sink2+win40+heavy2"]


class InjectedFailure(RuntimeError):
    pass


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", CFG, tiny_weights(CFG, seed=5))


def new_session(path, policy: str):
    loaded = load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)
    return build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse(policy), 256), OPTIONS)


def cache_state(cache, seq_id: int = 0):
    """Everything the cache holds for ``seq_id``, as plain values to compare exactly."""
    if isinstance(cache, PagedKVCache):
        return cache.pool.length(seq_id), cache.kv_bytes(seq_id)
    seq = cache._seq(seq_id)
    layers = [(layer.main_start, layer.n_tokens, [rows.view.clone() for rows in layer._all_rows()])
              for layer in seq.layers]
    return seq.n_seen, cache.pool.length(seq_id), layers


def assert_same_state(a, b):
    if not isinstance(a[-1], list):
        assert a == b
        return
    assert a[:2] == b[:2]
    for (start_a, n_a, rows_a), (start_b, n_b, rows_b) in zip(a[-1], b[-1]):
        assert (start_a, n_a) == (start_b, n_b)
        assert len(rows_a) == len(rows_b) and all(torch.equal(x, y) for x, y in zip(rows_a, rows_b))


def failing_attend(cache, fail_layer: int, after_attending: bool):
    """cache.attend that raises in layer ``fail_layer``, before it or after it wrote the layer."""
    real = cache.attend

    def attend(layer_idx, q, k, v):
        if layer_idx == fail_layer and not after_attending:
            raise InjectedFailure(f"allocation failed in layer {layer_idx}")
        out = real(layer_idx, q, k, v)
        if layer_idx == fail_layer:
            raise InjectedFailure(f"allocation failed after layer {layer_idx}")
        return out
    return attend


@pytest.mark.parametrize("policy", POLICIES)
def test_a_step_that_fails_in_any_layer_is_undone_exactly(tiny_gguf, policy, monkeypatch):
    failing, clean = new_session(tiny_gguf, policy), new_session(tiny_gguf, policy)
    engines = failing.engine, clean.engine
    for e in engines:
        e.cache.add_sequence(0)
    logits = [e.prefill(0, PROMPT) for e in engines]
    assert torch.equal(logits[0], logits[1])
    for step in range(STEPS):
        tok = int(logits[1].argmax())
        before = cache_state(failing.engine.cache)
        with monkeypatch.context() as m:
            m.setattr(failing.engine.cache, "attend",
                      failing_attend(failing.engine.cache, step % CFG.n_layers, after_attending=step % 2 == 0))
            with pytest.raises(InjectedFailure):
                failing.engine.decode([0], [tok])
        assert_same_state(cache_state(failing.engine.cache), before)
        logits = [e.decode([0], [tok])[0] for e in engines]
        assert torch.equal(logits[0], logits[1]), f"step {step}: the failed step left a trace"
    cache, held = failing.engine.cache, eviction.held_counts(KVPolicy.parse(policy), len(PROMPT) + STEPS)
    if policy == "fp16":
        assert cache.kv_tokens(0) == len(PROMPT) + STEPS
        return
    assert held.evicted_tokens > 0 or held.quant_groups > 0
    assert cache.evicted_tokens(0) == held.evicted_tokens  # the undone steps included evictions,
    assert cache._seq(0).layers[0].n_groups == held.quant_groups  # and quantization


def test_a_failed_prefill_chunk_is_undone_and_the_next_answer_matches_a_fresh_session(tiny_gguf, monkeypatch):
    policy = "int8+sink2+win24+heavy2"
    session = new_session(tiny_gguf, policy)
    params = GenerationParams(max_tokens=12)
    prompt = "the tent in the sea and the hat on the cat " * 2
    with monkeypatch.context() as m:
        cache = session.engine.cache
        m.setattr(cache, "attend", failing_attend(cache, 1, after_attending=True))
        with pytest.raises(InjectedFailure):
            list(session.generate(prompt, params))
    assert session.history == [] and session.engine.cache.length(0) == 0
    again = [e.token for e in session.generate(prompt, params) if e.kind == "token"]
    fresh = [e.token for e in new_session(tiny_gguf, policy).generate(prompt, params) if e.kind == "token"]
    assert again == fresh and len(fresh) == 12


def test_a_decode_failure_mid_answer_keeps_cache_and_history_in_step(tiny_gguf, monkeypatch):
    """The answer breaks after 5 tokens; the next turn (the same prompt) reuses what is cached and
    answers exactly as a session that never failed."""
    policy = "fp16+sink2+win16+heavy4"
    session = new_session(tiny_gguf, policy)
    params = GenerationParams(max_tokens=10)
    prompt = "in the tent on the sea"
    cache = session.engine.cache
    real_decode, calls = session.engine.decode, []

    def decode_then_fail(seq_ids, token_ids):
        calls.append(token_ids)
        if len(calls) == 5:
            with monkeypatch.context() as m:
                m.setattr(cache, "attend", failing_attend(cache, 2, after_attending=True))
                return real_decode(seq_ids, token_ids)
        return real_decode(seq_ids, token_ids)
    monkeypatch.setattr(session.engine, "decode", decode_then_fail)
    with pytest.raises(InjectedFailure):
        list(session.generate(prompt, params))
    monkeypatch.setattr(session.engine, "decode", real_decode)
    assert cache.length(0) == len(session.history)
    layers = cache._seq(0).layers
    assert len({layer.n_tokens for layer in layers}) == 1
    again = [e.token for e in session.generate(prompt, params) if e.kind == "token"]
    fresh = [e.token for e in new_session(tiny_gguf, policy).generate(prompt, params) if e.kind == "token"]
    assert again == fresh
