"""Every KV policy combination on the policy cache: batches, chunked prefill then decode, bytes equal
to the cost model at every step, the held tokens the eviction rules name, positions re-indexed."""
import itertools

import pytest
import torch

from localctx.backends.torch.rope import Rope
from localctx.kvcache import cost, quant
from localctx.kvcache.paged_attention import dense_attention
from localctx.kvcache.block_pool import PoolExhausted
from localctx.kvcache.errors import UserError
from localctx.kvcache.paged import CacheShape, PagedKVCache
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache
from localctx.kvcache.model_spec import ModelSpec

L, H, HKV, D = 2, 4, 2, 64
SPEC = ModelSpec("tiny", "llama", n_layers=L, n_heads=H, n_kv_heads=HKV, head_dim=D, hidden_size=H * D,
                 vocab_size=64, context_length=128, kv_elem_bytes=4)
ROPE = Rope(D, 10000.0)
SHAPE = PolicyCacheShape(L, HKV, D, torch.float32)

PRECISIONS = ["fp16", "int8", "int4", "int8+res16", "int4+g64+res40"]
EVICTIONS = ["", "+win96", "+sink4+win96", "+win40", "+sink4+win96+heavy40", "+win96+heavy8", "+sink2+win40+heavy5"]
MATRIX = [p + e for p, e in itertools.product(PRECISIONS, EVICTIONS)]
# keys and values apart, one side at full precision too
SPLITS = [p + e for p, e in itertools.product(["k8v4", "kf16v8", "kf16v4+res16", "k4vf16+g64"],
                                               ["", "+sink4+win96", "+sink2+win40+heavy5"])]
STEPS = [37, 40, 30] + [1] * 8 + [64, 5] + [1] * 6  # chunked prefill, decode, another chunk, decode


def stream(cache, seqs, steps, seed=0):
    """Drive the cache like a model: random q/k/v per layer per step. Yields after each step."""
    gen = torch.Generator().manual_seed(seed)
    for s in seqs:
        cache.add_sequence(s)
    for T in steps:
        cache.begin_step(seqs, T)
        outs = []
        for layer in range(L):
            q = torch.randn(len(seqs), T, H, D, generator=gen)
            k = torch.randn(len(seqs), T, HKV, D, generator=gen)
            v = torch.randn(len(seqs), T, HKV, D, generator=gen)
            outs.append(cache.attend(layer, q, k, v))
        cache.end_step()
        yield T, outs


@pytest.mark.parametrize("text", MATRIX + SPLITS)
def test_every_combination_streams_with_exact_bytes_and_held_tokens(text):
    policy = KVPolicy.parse(text)
    cache = PolicyKVCache(SHAPE, policy, ROPE)
    n = 0
    for T, outs in stream(cache, [0, 1], STEPS):
        n += T
        assert all(o.shape == (2, T, H, D) and torch.isfinite(o).all() for o in outs)
        for s in (0, 1):
            assert cache.length(s) == n
            assert cache.kv_bytes(s) == cost.kv_bytes(SPEC, policy, n), f"bytes differ at {n} tokens"
            assert cache.kv_tokens(s) == cost.held_tokens(policy, n)
            assert cache.evicted_tokens(s) == n - cost.held_tokens(policy, n)
        for layer in cache._seqs[0].layers:
            full_pos, q_pos = layer.positions()
            every = torch.cat([full_pos] + ([q_pos.reshape(-1)] if q_pos is not None else []))
            assert torch.equal(every.sort().values, torch.arange(layer.n_tokens)), "positions are not re-indexed"
            full_idx, group_idx = layer.stream_indices()
            idx = torch.cat([full_idx] + ([group_idx.reshape(-1)] if group_idx is not None else []))
            assert set(range(min(n, policy.sinks))) <= set(idx.tolist()), "a sink was evicted"
            newest = min(n - policy.sinks, policy.window or n)
            assert set(range(n - newest, n)) <= set(idx.tolist()), "a token inside the window was evicted"
    assert cache.kv_bytes() == 2 * cost.kv_bytes(SPEC, policy, n)
    assert cache.pool.length(0) == cost.held_tokens(policy, n)  # the pool's blocks cover what is held
    cache.finish(0)
    cache.finish(1)
    assert cache.pool.free_blocks == cache.pool.n_blocks


def test_full_precision_unbounded_policy_cache_equals_the_paged_cache():
    paged = PagedKVCache(CacheShape(L, HKV, D, n_blocks=64, block_size=16), ROPE)
    policy = PolicyKVCache(SHAPE, KVPolicy(), ROPE)
    for (_, a), (_, b) in zip(stream(paged, [0, 1], STEPS[:8]), stream(policy, [0, 1], STEPS[:8])):
        for x, y in zip(a, b):
            assert torch.allclose(x, y, atol=1e-5)


def test_sinks_and_window_attend_over_exactly_the_kept_tokens_at_reindexed_positions():
    """A reference built from scratch: keep the whole history; for each query p pick the sinks and
    the last W tokens before it (what decoding token p holds, whatever the step's size), itself
    last, rotate them at their ranks and run dense attention for that query alone."""
    S, W = 3, 20
    cache = PolicyKVCache(SHAPE, KVPolicy.parse(f"fp16+sink{S}+win{W}"), ROPE)
    cache.add_sequence(0)
    gen = torch.Generator().manual_seed(5)
    hist_k, hist_v = [[] for _ in range(L)], [[] for _ in range(L)]
    n = 0
    for T in [10, 15, 1, 1, 7, 1, 30, 1]:
        cache.begin_step([0], T)
        for layer in range(L):
            q, k, v = (torch.randn(1, T, h, D, generator=gen) for h in (H, HKV, HKV))
            out = cache.attend(layer, q, k, v)
            hist_k[layer].append(k[0]); hist_v[layer].append(v[0])
            allk, allv = torch.cat(hist_k[layer]), torch.cat(hist_v[layer])
            for t in range(T):
                p = n + t
                sel = torch.tensor(list(range(min(p, S))) + list(range(max(S, p - W), p)) + [p])
                pos = torch.arange(len(sel))[None]
                ref = dense_attention(ROPE.rotate(q[:, t:t + 1], pos[:, -1:]), ROPE.rotate(allk[sel][None], pos),
                                      allv[sel][None], pos[:, -1:])
                assert torch.allclose(out[:, t:t + 1], ref, atol=1e-5), f"query {p} differs"
        n += T


@pytest.mark.parametrize("text", ["int4+res16", "int8", "int4+g64+sink3", "k8v4+res16", "kf16v4", "k4vf16+g64+sink3"])
def test_an_unbounded_quantized_cache_keeps_the_head_group_exact(text):
    """A reference built from scratch: every token's exact K/V; for each query p, main-stream
    groups 1, 2, ... that are entirely older than the residual at p are quantized and dequantized
    (kvcache.quant), group 0 (the head) and the sinks are not; rotate at positions, dense attention."""
    policy = KVPolicy.parse(text)
    S, g, R = policy.sinks, policy.group_size, policy.residual
    cache = PolicyKVCache(SHAPE, policy, ROPE)
    cache.add_sequence(0)
    gen = torch.Generator().manual_seed(11)
    hist_k, hist_v = [[] for _ in range(L)], [[] for _ in range(L)]
    n = 0
    for T in [40, 1, 1, 30, 1, 70, 1, 100, 1]:
        cache.begin_step([0], T)
        n_groups = max(0, n - S - R) // g  # aligned main groups older than the residual, the head included
        for layer in range(L):
            q, k, v = (torch.randn(1, T, h, D, generator=gen) for h in (H, HKV, HKV))
            k[0, :, :, 0] += 8.0 * (torch.arange(T) + n == 0)[:, None]  # an outlier at token 0, as attention sinks have
            out = cache.attend(layer, q, k, v)
            hist_k[layer].append(k[0]); hist_v[layer].append(v[0])
            for t in range(T):
                p = n + t
                allk, allv = torch.cat(hist_k[layer])[:p + 1].clone(), torch.cat(hist_v[layer])[:p + 1].clone()
                for grp in range(1, max(0, p - S - R) // g):  # aligned main groups older than the residual at p
                    sel = slice(S + grp * g, S + (grp + 1) * g)
                    gk, gv = allk[sel].transpose(0, 1), allv[sel].transpose(0, 1)  # [H, g, D]
                    if policy.k_bits < 16:  # a side at 16 bits stays as it is
                        allk[sel] = quant.dequantize_keys(quant.quantize_keys(gk, policy.k_bits)).transpose(0, 1)
                    if policy.v_bits < 16:
                        allv[sel] = quant.dequantize_values(quant.quantize_values(gv, policy.v_bits, g), g).transpose(0, 1)
                pos = torch.arange(p + 1)[None]
                ref = dense_attention(ROPE.rotate(q[:, t:t + 1], pos[:, p:]), ROPE.rotate(allk[None], pos),
                                      allv[None], pos[:, p:])
                assert torch.allclose(out[:, t:t + 1], ref, atol=1e-5), f"{text}: attention differs at query {p}"
        layer0 = cache._seqs[0].layers[0]
        assert layer0.n_groups == max(0, (n + T - S - R) // g - 1)
        assert set(range(min(n + T, S + g))) <= set(layer0.full_idx.view.tolist()), "the head was quantized"
        n += T
    assert n_groups >= 3  # two or more quantized groups past the head


@pytest.mark.parametrize("bits,tol", [(8, 0.03), (4, 0.3)])
def test_quantized_cache_tracks_the_full_precision_cache(bits, tol):
    exact = PolicyKVCache(SHAPE, KVPolicy(), ROPE)
    lossy = PolicyKVCache(SHAPE, KVPolicy(k_bits=bits, v_bits=bits), ROPE)
    worst = 0.0
    steps = STEPS[:12] + [256, 256]  # 691 tokens: the 32-token full-precision head is a small part
    for (_, a), (_, b) in zip(stream(exact, [0], steps), stream(lossy, [0], steps)):
        worst = max(worst, max(float((x - y).abs().max()) for x, y in zip(a, b)))
    assert 0 < worst < tol
    assert lossy.kv_bytes(0) < exact.kv_bytes(0) * (0.4 if bits == 8 else 0.3)


@pytest.mark.parametrize("text", ["fp16+sink1+win8+heavy2", "int8+sink1+win64+heavy32"])
def test_heavy_hitters_keep_the_tokens_attention_keeps_returning_to(text):
    policy = KVPolicy.parse(text)
    cache = PolicyKVCache(SHAPE, policy, ROPE)
    cache.add_sequence(0)
    gen = torch.Generator().manual_seed(7)
    magnet = 5  # every query attends to this token's key
    direction = torch.zeros(D)
    direction[:] = 1.0
    n = 0
    for T in [20] + [1] * 100:
        cache.begin_step([0], T)
        for layer in range(L):
            q = torch.randn(1, T, H, D, generator=gen) * 0.1
            k = torch.randn(1, T, HKV, D, generator=gen) * 0.1
            q[..., 0] = 30.0  # channel 0 is untouched by RoPE at position 0 only; use the magnet's own rotation
            if n <= magnet < n + T:
                k[0, magnet - n] = 30.0
            v = torch.randn(1, T, HKV, D, generator=gen)
            cache.attend(layer, q, k, v)
        n += T
    for layer in cache._seqs[0].layers:
        held = set(layer.full_idx.view.tolist())
        if layer.n_groups:
            held |= set(layer.q_idx.view.reshape(-1).tolist())
        assert magnet in held, "the heavy hitter was evicted"
    assert cache.kv_bytes(0) == cost.kv_bytes(SPEC, policy, n)


def test_a_head_dim_that_is_not_a_multiple_of_the_group_is_refused_up_front():
    with pytest.raises(UserError, match="g32"):
        PolicyKVCache(PolicyCacheShape(L, HKV, 48), KVPolicy.parse("int4+g64"), Rope(48, 10000.0))


def test_truncate_keeps_a_prefix_only_while_nothing_was_evicted_or_quantized_away():
    cache = PolicyKVCache(SHAPE, KVPolicy.parse("int8+res64"), ROPE)
    list(stream(cache, [0], [20, 1, 1]))
    assert cache.can_truncate(0, 22) and cache.can_truncate(0, 10)
    cache.truncate(0, 10)
    assert cache.length(0) == 10 and cache.kv_tokens(0) == 10
    assert cache.kv_bytes(0) == cost.kv_bytes(SPEC, cache.policy, 10)
    list(stream(cache, [1], [200]))  # 4 groups quantized
    assert cache.can_truncate(1, 200) and cache.can_truncate(1, 64 + 128) and not cache.can_truncate(1, 150)
    with pytest.raises(ValueError, match="truncate to 0"):
        cache.truncate(1, 150)
    cache.truncate(1, 0)
    assert cache.kv_bytes(1) == 0 and cache.length(1) == 0
    windowed = PolicyKVCache(SHAPE, KVPolicy.parse("fp16+win16"), ROPE)
    list(stream(windowed, [0], [30]))
    assert windowed.can_truncate(0, 30) and not windowed.can_truncate(0, 20)


def test_a_window_cut_back_to_a_prefix_streams_on_like_one_that_never_saw_the_cut_tokens():
    gen = torch.Generator().manual_seed(11)
    tokens = [tuple(torch.randn(1, 1, h, D, generator=gen) for h in (H, HKV, HKV)) for _ in range(40)]
    junk = [tuple(torch.randn(1, 1, h, D, generator=gen) for h in (H, HKV, HKV)) for _ in range(4)]

    def feed(cache, steps):
        outs = []
        for q, k, v in steps:
            cache.begin_step([0], 1)
            outs.append(torch.stack([cache.attend(layer, q, k, v) for layer in range(L)]))
            cache.end_step()
        return outs

    policy = KVPolicy.parse("fp16+sink2+win16")
    cut, fresh = PolicyKVCache(SHAPE, policy, ROPE), PolicyKVCache(SHAPE, policy, ROPE)
    cut.add_sequence(0); fresh.add_sequence(0)
    feed(cut, tokens[:6] + junk)
    cut.truncate(0, 6)
    feed(fresh, tokens[:6])
    for a, b in zip(feed(cut, tokens[6:]), feed(fresh, tokens[6:])):  # past the window: both evict
        assert torch.equal(a, b)
    assert cut.kv_tokens(0) == fresh.kv_tokens(0) == 18
    assert torch.equal(cut._seqs[0].layers[0].stream_indices()[0], torch.tensor([0, 1] + list(range(24, 40))))


def test_a_full_pool_is_refused_before_the_step_and_a_window_streams_on_in_the_same_blocks():
    small = PolicyCacheShape(L, HKV, D, torch.float32, capacity_tokens=96, block_size=16)
    bounded = PolicyKVCache(small, KVPolicy.parse("int8+sink4+win40"), ROPE)
    list(stream(bounded, [0], [30] + [1] * 170))  # 200 tokens through 96 tokens of blocks
    assert bounded.pool.used_blocks == -(-cost.held_tokens(bounded.policy, 200) // 16)
    unbounded = PolicyKVCache(small, KVPolicy.parse("int8"), ROPE)
    with pytest.raises(PoolExhausted, match="pool is full"):
        list(stream(unbounded, [0], [30, 30, 30, 30]))
