"""The block pool and the full-precision paged cache: no leaks, no sharing, exact bytes, and
attention over blocks equal to dense attention over the same history."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localctx.backends.torch.rope import Rope
from localctx.kvcache import cost
from localctx.kvcache.paged_attention import dense_attention, run_attention
from localctx.kvcache.block_pool import BlockPool, PoolExhausted
from localctx.kvcache.paged import CacheShape, PagedKVCache
from localctx.kvcache.policy import FP16
from localctx.kvcache.model_spec import ModelSpec

SPEC = ModelSpec(name="tiny", architecture="llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 hidden_size=32, vocab_size=64, context_length=256, kv_elem_bytes=4)


def tiny_cache(n_blocks: int = 12, block_size: int = 4) -> PagedKVCache:
    shape = CacheShape(n_layers=SPEC.n_layers, n_kv_heads=SPEC.n_kv_heads, head_dim=SPEC.head_dim,
                       n_blocks=n_blocks, block_size=block_size, dtype=torch.float32)
    return PagedKVCache(shape, Rope(SPEC.head_dim, 10000.0))


def check_invariants(cache: PagedKVCache, expected_lengths: dict[int, int]) -> None:
    pool = cache.pool
    owned: list[int] = []
    for seq_id, n in expected_lengths.items():
        table = pool.block_table(seq_id)
        assert pool.length(seq_id) == n
        assert len(table) == pool.blocks_for(n)
        owned.extend(table)
        assert cache.kv_bytes(seq_id) == cost.kv_bytes(SPEC, FP16, n)
        assert cache.reserved_bytes(seq_id) == cost.paged_kv_bytes(SPEC, FP16, n, pool.block_size)
    reserved = [b for seq_id in expected_lengths for b in pool._seq(seq_id).reserved]
    held = owned + reserved
    assert len(held) == len(set(held)), "a block is shared by two live sequences (or reserved twice)"
    assert set(held).isdisjoint(pool._free), "a block is both free and in use"
    assert len(held) + pool.free_blocks == pool.n_blocks, "blocks leaked"
    assert pool.used_blocks == len(owned) and pool.reserved_blocks == len(reserved)
    assert cache.kv_bytes() == sum(cost.kv_bytes(SPEC, FP16, n) for n in expected_lengths.values())
    assert cache.reserved_bytes() == len(owned) * pool.block_size * cost.full_bytes_per_token(SPEC)


op = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("admit"), st.integers(0, 5), st.integers(1, 30)),  # with a reservation
    st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 9)),
    st.tuples(st.just("truncate"), st.integers(0, 5), st.integers(0, 20)),
    st.tuples(st.just("finish"), st.integers(0, 5), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
def test_random_admit_grow_finish_keeps_the_pool_exact(ops):
    cache = tiny_cache()
    lengths: dict[int, int] = {}
    for kind, seq_id, n in ops:
        if kind == "admit":
            if seq_id in lengths:
                with pytest.raises(ValueError):
                    cache.add_sequence(seq_id, n)
            elif cache.pool.blocks_for(n) > cache.pool.free_blocks:
                with pytest.raises(PoolExhausted):
                    cache.add_sequence(seq_id, n)
            else:
                cache.add_sequence(seq_id, n)
                lengths[seq_id] = 0
        elif seq_id not in lengths:
            with pytest.raises(KeyError):
                cache.finish(seq_id) if kind == "finish" else cache.pool.block_table(seq_id)
        elif kind == "grow":
            before = (cache.pool.free_blocks, dict(lengths))
            need = cache.pool.free_blocks_needed(seq_id, n)
            if need > cache.pool.free_blocks:
                with pytest.raises(PoolExhausted):
                    cache.begin_step([seq_id], n)
                assert cache.pool.free_blocks == before[0]  # a refused step changes nothing
            else:
                table_before = list(cache.pool.block_table(seq_id))
                cache.begin_step([seq_id], n)
                cache.end_step()
                assert cache.pool.block_table(seq_id)[:len(table_before)] == table_before  # no copy, no move
                lengths[seq_id] += n
        elif kind == "truncate":
            keep = min(n, lengths[seq_id])
            cache.truncate(seq_id, keep)
            lengths[seq_id] = keep
        else:
            cache.finish(seq_id)
            del lengths[seq_id]
        check_invariants(cache, lengths)
    for seq_id in list(lengths):
        cache.finish(seq_id)
    assert cache.pool.free_blocks == cache.pool.n_blocks


def test_pool_refuses_bad_sizes_and_unknown_sequences():
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    pool = BlockPool(2, 4)
    pool.admit(1)
    with pytest.raises(PoolExhausted, match="pool is full"):
        pool.grow(1, 9)
    with pytest.raises(KeyError):
        pool.finish(7)


def _history_attention(rope: Rope, q, ks, vs, start: int):
    """Dense reference: q [1,T,H,D] at positions start.., over all keys so far."""
    T = q.shape[1]
    pos_q = torch.arange(start, start + T)[None]
    k = torch.cat(ks, dim=1)
    pos_k = torch.arange(k.shape[1])[None]
    return dense_attention(rope.rotate(q, pos_q), rope.rotate(k, pos_k), torch.cat(vs, dim=1), pos_q)


@pytest.mark.parametrize("reserve", [0, 32])
def test_paged_attention_matches_dense_for_chunks_and_ragged_batches(reserve):
    """reserve=0: sequences grow interleaved, so their blocks are scattered (gathered path);
    reserve=32: each sequence gets consecutive blocks (the view-per-sequence decode path)."""
    torch.manual_seed(0)
    cache = tiny_cache(n_blocks=40, block_size=4)
    H, Hkv, D = SPEC.n_heads, SPEC.n_kv_heads, SPEC.head_dim
    prompts = {0: 7, 1: 13, 2: 2}
    hist = {s: ([], []) for s in prompts}
    for s, n in prompts.items():  # chunked prefill, interleaved
        cache.add_sequence(s, reserve)
    for chunk in range(4):
        for s, n in prompts.items():
            T = min(4, n - 4 * chunk)
            if T <= 0:
                continue
            q, k, v = torch.randn(1, T, H, D), torch.randn(1, T, Hkv, D), torch.randn(1, T, Hkv, D)
            start = cache.length(s)
            cache.begin_step([s], T)
            out = cache.attend(1, q, k, v)
            cache.end_step()
            hist[s][0].append(k)
            hist[s][1].append(v)
            ref = _history_attention(cache.rope, q, *hist[s], start)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for _ in range(3):  # batched decode over sequences of different lengths
        seqs = [0, 1, 2]
        q, k, v = torch.randn(3, 1, H, D), torch.randn(3, 1, Hkv, D), torch.randn(3, 1, Hkv, D)
        starts = [cache.length(s) for s in seqs]
        cache.begin_step(seqs, 1)
        assert (cache.step.runs is not None) == bool(reserve)
        out = cache.attend(1, q, k, v)
        cache.end_step()
        for i, s in enumerate(seqs):
            hist[s][0].append(k[i:i + 1])
            hist[s][1].append(v[i:i + 1])
            ref = _history_attention(cache.rope, q[i:i + 1], *hist[s], starts[i])
            torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)
    assert cache.kv_bytes() == sum(cost.kv_bytes(SPEC, FP16, n + 3) for n in prompts.values())


def test_attend_outside_a_step_or_with_the_wrong_shape_is_refused():
    cache = tiny_cache()
    cache.add_sequence(0)
    q, kv = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 2, 8)
    with pytest.raises(RuntimeError, match="begin_step"):
        cache.attend(0, q, kv, kv)
    cache.begin_step([0], 3)
    with pytest.raises(ValueError, match="T=2"):
        cache.attend(0, q, kv, kv)


def test_bf16_cache_bytes_follow_the_element_size():
    shape = CacheShape(n_layers=2, n_kv_heads=2, head_dim=8, n_blocks=4, block_size=4, dtype=torch.bfloat16)
    cache = PagedKVCache(shape, Rope(8, 10000.0, dtype=torch.bfloat16))
    cache.add_sequence(0)
    cache.begin_step([0], 5)
    spec2 = dataclasses.replace(SPEC, kv_elem_bytes=2)
    assert cache.kv_bytes() == cost.kv_bytes(spec2, FP16, 5) == 5 * 2 * 2 * 2 * 8 * 2
    assert cache.pool_bytes() == 4 * 4 * 2 * 2 * 2 * 8 * 2


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (9, 3)])
def test_decode_over_block_runs_matches_dense_attention_with_grouped_queries(heads, kv_heads):
    """run_attention hands SDPA each KV head's query heads as rows (no K/V expansion): same result."""
    torch.manual_seed(heads)
    bs, D = 4, 16
    lengths = [1, 7, 13]  # tokens held per sequence, the new one included; not multiples of the block
    firsts, n_blocks = [], 0
    for n in lengths:
        firsts.append(n_blocks)
        n_blocks += -(-n // bs) + 1  # a free block between runs
    k_blocks = torch.randn(n_blocks, bs, kv_heads, D)
    v_blocks = torch.randn(n_blocks, bs, kv_heads, D)
    q = torch.randn(len(lengths), 1, heads, D)
    out = run_attention(q, k_blocks, v_blocks, list(zip(firsts, lengths)), scale=0.3)
    for b, (first, n) in enumerate(zip(firsts, lengths)):
        k = k_blocks[first:].reshape(-1, kv_heads, D)[:n][None]
        v = v_blocks[first:].reshape(-1, kv_heads, D)[:n][None]
        want = dense_attention(q[b:b + 1], k, v, torch.tensor([[n - 1]]), scale=0.3)
        torch.testing.assert_close(out[b:b + 1], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one token per sequence"):
        run_attention(torch.randn(1, 2, heads, D), k_blocks, v_blocks, [(0, 2)])
