"""TorchSession behaviour on a tiny random-weight GGUF: multi-turn prefix reuse, sampling,
stops, cancellation, refusals, exact KV bytes, and `localctx run --backend torch`."""
from __future__ import annotations

import io
import json
import threading

import pytest
import torch

from localctx.app import cli
from localctx.backends.base import GenerationParams
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    cfg = TinyConfig()
    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", cfg, tiny_weights(cfg, seed=11))


@pytest.fixture
def session(tiny_gguf):
    loaded = load_model(ModelRef("gguf", tiny_gguf, "tiny", "file"), OPTIONS)
    return build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy(), 200), OPTIONS)


def tokens_of(events) -> list[int]:
    return [e.token for e in events if e.kind == "token"]


@pytest.fixture(scope="module")
def tiny_gguf_head32(tmp_path_factory):  # quantized KV needs whole groups of 32 channels
    cfg = TinyConfig(hidden=64, n_heads=2, n_kv_heads=1, head_dim=32)
    return write_gguf(tmp_path_factory.mktemp("tiny32") / "tiny.gguf", cfg, tiny_weights(cfg, seed=11))


@pytest.mark.parametrize("policy", ["fp16", "fp16+sink4+win160", "int8+res32"])
def test_second_turn_reuses_the_cached_prefix_and_matches_a_fresh_session(tiny_gguf, tiny_gguf_head32, policy):
    # the policy cache (windowed, quantized) is cut back outside the engine's inference mode here
    tiny_gguf = tiny_gguf_head32 if policy.startswith("int") else tiny_gguf
    loaded = load_model(ModelRef("gguf", tiny_gguf, "tiny", "file"), OPTIONS)
    session = build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse(policy), 200), OPTIONS)
    params = GenerationParams(max_tokens=8)
    turn1 = [{"role": "user", "content": "the tent in the sea"}]
    events = list(session.generate(turn1, params))
    assert events[-1].stats.cached_tokens == 0
    answer = "".join(e.text for e in events)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and the hat?"}]
    events2 = list(session.generate(turn2, params))
    stats = events2[-1].stats
    n_turn1 = session.count_tokens(turn1)
    assert stats.cached_tokens >= n_turn1  # at least the whole first prompt was not prefilled again
    assert stats.prompt_tokens == session.count_tokens(turn2)
    fresh = build_session(load_model(ModelRef("gguf", tiny_gguf, "t", "file"), OPTIONS), session.plan, OPTIONS)
    assert tokens_of(events2) == tokens_of(fresh.generate(turn2, params))


def test_kv_bytes_in_events_equal_the_cost_model(session):
    events = list(session.generate("the hat in the tent", GenerationParams(max_tokens=5)))
    for e in events:
        assert e.stats.kv_bytes == cost.kv_bytes(session.spec, KVPolicy(), e.stats.kv_tokens)
    assert session.spec.kv_elem_bytes == 4  # an fp32 cache
    last = events[-1].stats
    assert last.kv_tokens == last.prompt_tokens + max(0, last.generated_tokens - 1) or last.kv_tokens == (
        last.prompt_tokens + last.generated_tokens)


def test_seeded_sampling_repeats_and_top_k_1_is_greedy(session):
    sampled = GenerationParams(max_tokens=10, temperature=1.5, top_p=0.95, seed=7)
    a = tokens_of(session.generate("in the sea", sampled))
    session.reset()
    b = tokens_of(session.generate("in the sea", sampled))
    assert a == b
    other = tokens_of(session.generate("in the sea", GenerationParams(max_tokens=10, temperature=1.5, seed=8)))
    greedy = tokens_of(session.generate("in the sea", GenerationParams(max_tokens=10)))
    top1 = tokens_of(session.generate("in the sea", GenerationParams(max_tokens=10, temperature=2.0, top_k=1, seed=3)))
    assert top1 == greedy
    assert a != greedy or other != greedy  # sampling at temperature 1.5 departs from greedy


def test_cancel_and_stop_strings_end_the_answer(session):
    cancel = threading.Event()
    seen = []
    for e in session.generate("the tent", GenerationParams(max_tokens=50), cancel):
        seen.append(e)
        if len(seen) == 2:
            cancel.set()
    assert seen[-1].kind == "done" and seen[-1].finish_reason == "cancelled"
    assert seen[-1].stats.generated_tokens == 2
    full = "".join(e.text for e in session.generate("the tent", GenerationParams(max_tokens=20)))
    if len(full) > 4:
        stop = full[2:4]
        events = list(session.generate("the tent", GenerationParams(max_tokens=20, stop=(stop,))))
        assert events[-1].finish_reason == "stop"
        assert stop not in "".join(e.text for e in events)


def test_a_prompt_longer_than_the_context_is_refused_not_truncated(session):
    with pytest.raises(UserError, match="context holds"):
        list(session.generate("the " * 300, GenerationParams(max_tokens=4)))
    with pytest.raises(UserError, match="prompt 2 of 2"):
        list(session.generate_batch(["hi", "the " * 300], GenerationParams(max_tokens=4)))


def test_generation_stops_at_the_end_of_the_context(session):
    prompt = "the " * 90
    n = session.count_tokens(prompt)
    events = list(session.generate(prompt, GenerationParams(max_tokens=500)))
    assert events[-1].stats.generated_tokens <= session.plan.context - n
    assert session.engine.cache.kv_tokens(0) < session.plan.context


def test_cli_run_with_the_torch_backend(tiny_gguf, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    monkeypatch.setenv("LOCALCTX_TORCH_DEVICE", "cpu")
    monkeypatch.setenv("LOCALCTX_TORCH_DTYPE", "fp32")
    code = cli.main(["run", "-m", str(tiny_gguf), "--backend", "torch", "--context", "128", "--max-tokens", "6",
                     "--json", "the hat"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert data["backend"] == "torch" and data["stats"]["generated_tokens"] >= 1
    monkeypatch.setenv("LOCALCTX_TORCH_DTYPE", "fp64")
    assert cli.main(["run", "-m", str(tiny_gguf), "--backend", "torch", "hi"]) == 2
    assert "LOCALCTX_TORCH_DTYPE" in capsys.readouterr().err
