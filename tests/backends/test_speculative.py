"""Prompt-lookup speculative decoding: the drafter, the acceptance rule, the caches' exact rollback,
and greedy output identical with and without it on the torch engine (tiny random-weight model)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from localctx.backends.base import GenerationParams
from localctx.backends.models.ref import ModelRef
from localctx.backends.generation.speculation import NgramDrafter, TokenPicker, resolve
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)


def test_drafter_continues_the_most_recent_occurrence_of_the_longest_suffix():
    d = NgramDrafter()
    d.extend([1, 2, 3, 9, 9, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    # "1 2 3" occurred once before (followed by 9 9); "2 3" last at index 5 (followed by 4 5 6)
    assert d.draft(2) == [9, 9]
    d.extend([8])
    assert d.draft(3) == []  # 8 never occurred before
    d.extend([5])
    assert d.draft(3) == [6, 7, 1]  # 1-gram "5"
    assert d.draft(0) == []


def test_greedy_acceptance_keeps_exactly_the_argmax_tokens():
    picker = TokenPicker(GenerationParams(temperature=0.0))
    logits = np.array([[0, 5, 1], [3, 0, 1], [0, 0, 9]], dtype=np.float32)
    assert picker.verify(logits[:2], [1]) == (1, 0)  # draft 1 agreed, then argmax of row 1
    assert picker.verify(logits, [1, 2]) == (1, 0)  # row 1 wants 0, not 2
    assert picker.verify(logits, [1, 0]) == (2, 2)  # all accepted, bonus from the last row


def test_sampling_acceptance_leaves_the_target_distribution_unchanged():
    params = GenerationParams(temperature=1.0, seed=3)
    picker = TokenPicker(params)
    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=np.float32))
    n = 20000
    counts = np.zeros(3)
    for _ in range(n):
        accepted, tok = picker.verify(logits, [1])  # a point-mass draft on the 0.3 token
        counts[1 if accepted else tok] += 1
    assert np.allclose(counts / n, [0.5, 0.3, 0.2], atol=0.015)


def test_heavy_hitters_refuse_ngram_and_auto_says_why():
    heavy = KVPolicy.parse("int8+sink4+heavy32+win256")
    with pytest.raises(UserError, match="heavy-hitter"):
        resolve("ngram", heavy)
    assert resolve("auto", heavy).startswith("off (heavy-hitter")
    assert resolve("auto", KVPolicy.parse("int4+sink4+win256")) == "ngram"
    assert resolve("off", KVPolicy()) == "off"
    with pytest.raises(UserError, match="--speculate"):
        resolve("medusa", KVPolicy())


@pytest.fixture(scope="module")
def tiny_head32(tmp_path_factory):  # quantized KV needs whole groups of 32 channels
    cfg = TinyConfig(hidden=64, n_heads=2, n_kv_heads=1, head_dim=32)
    path = write_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", cfg, tiny_weights(cfg, seed=5))
    return load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)


def generate(loaded, policy: str, prompt: str, speculate: str, n: int = 60):
    session = build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse(policy), 400), OPTIONS)
    events = list(session.generate(prompt, GenerationParams(max_tokens=n, speculate=speculate)))
    tokens = [e.token for e in events if e.kind == "token"]
    return tokens, events[-1].stats, session


PROMPTS = ["the tent in the sea the tent in the sea the tent in",
           "a hat; a hat; on the rat, in the hat; and then"]


CASES = [(policy, PROMPTS[0]) for policy in ("fp16", "int8+res32", "int4", "int4+sink4+win64", "fp16+sink4+win48")] + \
    [(policy, PROMPTS[1]) for policy in ("fp16", "int4+sink4+win64")]


@pytest.mark.parametrize("policy,prompt", CASES)
def test_greedy_output_is_identical_with_and_without_prompt_lookup(tiny_head32, policy, prompt):
    plain, _, _ = generate(tiny_head32, policy, prompt, "off", n=40)
    drafted, stats, session = generate(tiny_head32, policy, prompt, "ngram", n=40)
    assert drafted == plain
    assert stats.speculate == "ngram" and stats.decode_steps > 0
    # the cache holds exactly the tokens one-at-a-time decoding would: bytes match the cost model
    cache = session.engine.cache
    n_cached = len(session.history)
    assert n_cached == stats.prompt_tokens + len(drafted) - 1
    assert cache.kv_bytes(0) == cost.kv_bytes(session.spec, KVPolicy.parse(policy), n_cached)


def test_prompt_lookup_accepts_drafts_on_repeated_text(tiny_head32):
    _, stats, _ = generate(tiny_head32, "fp16", PROMPTS[0], "ngram", n=80)
    assert stats.accepted_tokens > 0
    assert stats.tokens_per_step > 1.0
    assert stats.decode_steps < stats.generated_tokens - 1


def test_rolled_back_policy_cache_equals_one_filled_token_by_token(tiny_head32):
    policy = KVPolicy.parse("int4+sink4+win64")
    a = build_session(tiny_head32, Plan.fixed("torch", tiny_head32.spec, policy, 400), OPTIONS)
    b = build_session(tiny_head32, Plan.fixed("torch", tiny_head32.spec, policy, 400), OPTIONS)
    ids = a.tokenize(PROMPTS[1])
    for s in (a, b):
        s.engine.cache.add_sequence(0)
        s.engine.prefill(0, ids)
    cache = a.engine.cache
    extra = [5, 6, 7, 8, 9]
    room = cache.append_room(0)
    assert room >= 1
    a.engine.prefill(0, extra[:room])  # one step of up to `room` tokens, then undo all but the first
    cache.drop_newest(0, min(room, len(extra)) - 1)
    b.engine.decode([0], extra[:1])
    assert cache.kv_bytes(0) == b.engine.cache.kv_bytes(0) and cache.length(0) == b.engine.cache.length(0)
    la, lb = a.engine.decode([0], [11]), b.engine.decode([0], [11])
    # equal up to float rounding: the kept token's K/V came out of a wider matmul than one row
    assert torch.allclose(la, lb, atol=1e-4, rtol=1e-4)
    assert torch.equal(la.argmax(-1), lb.argmax(-1))
    with pytest.raises(ValueError):
        cache.drop_newest(0, cache.length(0) + 1)


@pytest.fixture(scope="module")
def smollm2_torch(smollm2_path):
    """The real SmolLM2 loaded once for the module as ``TorchBackend.load`` loads it; each policy
    gets its own session (cache) over the same weights."""
    from localctx.backends.models.ref import resolve
    from localctx.backends.torch.backend import TorchBackend

    options = TorchBackend().options()
    return load_model(resolve(str(smollm2_path)), options), options


# full precision (the paged cache's rollback) is checked on the tiny model above with both prompts;
# the real model runs the policy cache's harder paths: quantized groups, and groups plus a window
@pytest.mark.slow
@pytest.mark.parametrize("kv", ["int4", "int8+sink4+win96"])
def test_greedy_output_is_identical_with_and_without_prompt_lookup_on_smollm2(smollm2_torch, kv, monkeypatch):
    import pydoc_data.topics as topics

    from localctx.backends.generation.draft_policy import StepCost

    # the draft planner weighs drafts by wall-clock step timings, which a loaded machine scatters
    # (a verify step can look dearer than its gain, and nothing is drafted): pin the measured cost
    # at a quiet machine's, so this test checks the rollback's exactness whatever the load
    monkeypatch.setattr(StepCost, "step_ratio", lambda self, n_tokens: 1 + 0.2 * (n_tokens - 1))

    from localctx.app.session_options import SessionRequest, plan_session

    loaded, options = smollm2_torch
    planned = plan_session(SessionRequest(model=None, backend="torch", kv=kv, context=1024))  # what run plans
    prompts = [[{"role": "user", "content": "Copy this text exactly:\n\n" + topics.topics["calls"].strip()[:500]}],
               [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}]]
    with build_session(loaded, planned.plan, options) as s:
        accepted = 0
        for prompt in prompts:
            runs = {}
            for mode in ("off", "ngram"):
                s.reset()
                events = list(s.generate(prompt, GenerationParams(max_tokens=32, speculate=mode)))
                runs[mode] = [e.token for e in events if e.kind == "token"]
            assert runs["ngram"] == runs["off"]
            accepted += events[-1].stats.accepted_tokens
        assert accepted > 0
