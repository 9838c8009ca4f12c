"""A 20,000-token stream of decode steps through int4+sink4+win2048 holds constant KV bytes: the
cache never grows past the cost model's peak, and every step's bytes equal its prediction."""
import pytest
import torch

from localctx.backends.torch.rope import Rope
from localctx.kvcache import cost
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache
from localctx.kvcache.model_spec import ModelSpec

HKV, D = 1, 64
SPEC = ModelSpec("one-layer", "llama", n_layers=1, n_heads=2, n_kv_heads=HKV, head_dim=D, hidden_size=2 * D,
                 vocab_size=64, context_length=8192, kv_elem_bytes=4)


def run_stream(text: str, steps: list[int]) -> tuple[PolicyKVCache, set[int], int]:
    """Streams random q/k/v through one layer; returns the cache, the byte figures seen after the
    window first filled, and the cost model's peak."""
    policy = KVPolicy.parse(text)
    cache = PolicyKVCache(PolicyCacheShape(1, HKV, D, torch.float32, capacity_tokens=4096), policy,
                          Rope(D, 10000.0))
    cache.add_sequence(0)
    gen = torch.Generator().manual_seed(0)
    total = sum(steps)
    peak = cost.max_kv_bytes(SPEC, policy, total)
    after_fill, n = set(), 0
    for T in steps:
        cache.begin_step([0], T)
        q, k, v = (torch.randn(1, T, h, D, generator=gen) for h in (2, HKV, HKV))
        out = cache.attend(0, q, k, v)
        cache.end_step()
        n += T
        assert torch.isfinite(out).all()
        held = cache.kv_bytes(0)
        assert held == cost.kv_bytes(SPEC, policy, n) <= peak
        if n >= policy.capacity() + 2 * policy.group_size:
            after_fill.add(held)
    assert cache.length(0) == total
    return cache, after_fill, peak


@pytest.mark.slow
def test_twenty_thousand_tokens_through_int4_sink4_win2048_hold_constant_bytes():
    # 20,008 tokens: a 1,000-token prompt, then steps of 64 tokens (a whole number of groups, so every
    # step ends in the same phase; what the cache holds depends only on the token count, and the
    # single-token test below covers every phase)
    cache, after_fill, peak = run_stream("int4+sink4+win2048", [1000] + [64] * 297)
    assert cache.kv_tokens(0) <= 4 + 2048 + 31
    assert len(after_fill) == 1 and max(after_fill) <= peak  # the same bytes after every step


def test_single_token_decode_steps_hold_constant_bytes_once_the_window_is_full():
    cache, after_fill, peak = run_stream("int4+sink4+win128", [40] + [1] * 600)
    assert cache.kv_tokens(0) <= 4 + 128 + 31
    assert max(after_fill) == peak and len(after_fill) <= 2 * 32  # one group's worth of phases, then repeat
