"""A 20,000-token stream of decode steps through int4+sink4+win2048 holds constant KV bytes: the
cache never grows past the cost model's peak, and every step's bytes equal its prediction."""
import pytest
import torch

from localctx.backends.torch.rope import Rope
from localctx.kvcache import cost
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache
from localctx.kvcache.spec import ModelSpec

HKV, D = 1, 64
SPEC = ModelSpec("one-layer", "llama", n_layers=1, n_heads=2, n_kv_heads=HKV, head_dim=D, hidden_size=2 * D,
                 vocab_size=64, context_length=8192, kv_elem_bytes=4)


@pytest.mark.slow
def test_twenty_thousand_decode_steps_run_at_constant_kv_bytes():
    policy = KVPolicy.parse("int4+sink4+win2048")
    cache = PolicyKVCache(PolicyCacheShape(1, HKV, D, torch.float32, capacity_tokens=4096), policy,
                          Rope(D, 10000.0))
    cache.add_sequence(0)
    gen = torch.Generator().manual_seed(0)
    peak = cost.max_kv_bytes(SPEC, policy, 20_000)
    after_fill = set()
    x = torch.randn(20_000, 3, 2, D, generator=gen)
    for n in range(20_000):
        cache.begin_step([0], 1)
        q, k, v = x[n, 0][None, None], x[n, 1, :HKV][None, None], x[n, 2, :HKV][None, None]
        out = cache.attend(0, q, k, v)
        cache.end_step()
        assert torch.isfinite(out).all()
        held = cache.kv_bytes(0)
        assert held == cost.kv_bytes(SPEC, policy, n + 1) <= peak
        if n >= 4 + 2048 + 64:
            after_fill.add(held)
    assert cache.length(0) == 20_000 and cache.kv_tokens(0) <= 4 + 2048 + 31
    # once the window is full the bytes cycle through one group's worth of states, never growing
    assert max(after_fill) == peak and len(after_fill) <= 2 * policy.group_size
