"""Triton kernels against their pure-torch references, on CPU through Triton's interpreter
(TRITON_INTERPRET=1; every launch is slow there, so shapes are small)."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # set by the process that runs these, never in-process
    pytest.skip("the Triton interpreter tests run in their own process (tests/kernels_cuda/test_triton_interpreter.py)",
                allow_module_level=True)

import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install 'localctx[dev]')")

from localctx.backends.torch.rope import Rope  # noqa: E402
from localctx.kernels_cuda import launch  # noqa: E402
from localctx.kernels_cuda.paged_attention import paged_attention, reference as paged_reference  # noqa: E402
from localctx.kernels_cuda.quant_append import QuantPool, quantize_append, quantize_append_reference  # noqa: E402
from localctx.kernels_cuda.quant_attention import attend, reference as attend_ref  # noqa: E402
from localctx.kvcache import quant  # noqa: E402
from localctx.kvcache.quant_attention import FullTokens, QuantGroups  # noqa: E402

ATOL = 2e-4  # fp32; keys are rotated from fp32 angles in the kernel, float64 tables in the reference


def quant_groups(k: torch.Tensor, v: torch.Tensor, bits: int, g: int, positions: torch.Tensor) -> QuantGroups:
    """k, v: [Hkv, G*g, D] → the reference layout, built with kvcache.quant."""
    G = k.shape[1] // g
    ks = [quant.quantize_keys(k[:, i * g:(i + 1) * g], bits) for i in range(G)]
    vs = [quant.quantize_values(v[:, i * g:(i + 1) * g], bits, g) for i in range(G)]
    stack = lambda qs: quant.QuantizedTensor(torch.stack([x.codes for x in qs]), torch.stack([x.scale for x in qs]),
                                             torch.stack([x.min for x in qs]), bits)
    return QuantGroups(stack(ks), stack(vs), positions.reshape(G, g), g)


def policy_inputs(seed, *, D, g, bits, Hq, Hkv, G, N, T, gap=0):
    """G quantized groups then N full-precision tokens (the last T are the queries); ``gap``
    leaves sinks ahead of the groups, as the policy cache orders them."""
    torch.manual_seed(seed)
    n_q = G * g
    quant_pos = torch.arange(gap, gap + n_q)
    full_pos = torch.cat([torch.arange(gap), torch.arange(gap + n_q, gap + n_q + N - gap)])
    groups = quant_groups(torch.randn(Hkv, n_q, D) * 2, torch.randn(Hkv, n_q, D), bits, g, quant_pos) if G else None
    full = FullTokens(torch.randn(Hkv, N, D) * 2, torch.randn(Hkv, N, D), full_pos)
    q = torch.randn(T, Hq, D)
    q_pos = full_pos[-T:]
    return q, q_pos, full, groups


POLICY_SHAPES = [  # D, g, Hq, Hkv, G, N, T, sinks ahead of the groups, want_mass, splits
    pytest.param(64, 32, 6, 2, 3, 21, 1, 0, False, 3, id="d64-g32-gqa3-decode"),
    pytest.param(128, 64, 8, 2, 2, 37, 2, 4, True, 2, id="d128-g64-gqa4-sinks-mass"),
    pytest.param(64, 64, 3, 3, 1, 9, 3, 0, True, 1, id="d64-g64-mha-prefill-mass"),
    pytest.param(128, 32, 4, 1, 0, 45, 1, 0, True, 4, id="d128-full-only-mqa-mass"),
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("D,g,Hq,Hkv,G,N,T,gap,want_mass,splits", POLICY_SHAPES)
def test_policy_attention_matches_reference(bits, D, g, Hq, Hkv, G, N, T, gap, want_mass, splits):
    q, q_pos, full, groups = policy_inputs(bits * 100 + D + G, D=D, g=g, bits=bits, Hq=Hq, Hkv=Hkv, G=G, N=N, T=T,
                                           gap=gap)
    rope = Rope(D, 10000.0)
    ref = attend_ref(q, q_pos, full, groups, rope, want_mass=want_mass)
    got = attend(q, q_pos, full, groups, rope, want_mass=want_mass, config=launch.LaunchConfig(splits=splits, block_n=16))
    assert got.out.shape == ref.out.shape and got.out.dtype == ref.out.dtype
    torch.testing.assert_close(got.out, ref.out, atol=ATOL, rtol=1e-3)
    if want_mass:
        torch.testing.assert_close(got.full_mass, ref.full_mass, atol=ATOL, rtol=1e-3)
        assert (got.quant_mass is None) == (ref.quant_mass is None)
        if ref.quant_mass is not None:
            torch.testing.assert_close(got.quant_mass, ref.quant_mass, atol=ATOL, rtol=1e-3)
        total = got.full_mass.sum() + (got.quant_mass.sum() if got.quant_mass is not None else 0)
        assert abs(float(total) - T * Hq) < 1e-3  # every query head's probabilities sum to 1
    else:
        assert got.full_mass is None and got.quant_mass is None


def test_policy_attention_uses_scale_and_sees_only_earlier_positions():
    q, q_pos, full, groups = policy_inputs(7, D=64, g=32, bits=8, Hq=2, Hkv=1, G=1, N=8, T=4)
    rope = Rope(64, 10000.0)
    ref = attend_ref(q, q_pos, full, groups, rope, scale=0.3)
    got = attend(q, q_pos, full, groups, rope, scale=0.3, config=launch.LaunchConfig(splits=2, block_n=16))
    torch.testing.assert_close(got.out, ref.out, atol=ATOL, rtol=1e-3)
    # changing the newest token's value moves only the query that sees it (the last one)
    full2 = FullTokens(full.k, full.v.clone(), full.positions)
    full2.v[:, -1] += 1000.0
    moved = attend(q, q_pos, full2, groups, rope, scale=0.3, config=launch.LaunchConfig(splits=2, block_n=16)).out
    assert torch.allclose(moved[:-1], got.out[:-1], atol=1e-6)
    assert not torch.allclose(moved[-1], got.out[-1], atol=1e-2)


def test_quantized_groups_are_read_through_a_group_table():
    """Paged quantized blocks: the groups sit anywhere in a pool, in block-table order."""
    D, g, bits, Hkv, Hq = 64, 32, 4, 2, 4
    q, q_pos, full, groups = policy_inputs(11, D=D, g=g, bits=bits, Hq=Hq, Hkv=Hkv, G=3, N=5, T=1)
    rope = Rope(D, 10000.0)
    order = torch.tensor([4, 1, 2])  # group i of the sequence lives in pool slot order[i]
    pool = QuantPool.empty(6, Hkv, D, bits, g)
    for i, slot in enumerate(order.tolist()):
        pool.k_codes[slot], pool.k_scale[slot], pool.k_min[slot] = groups.k.codes[i], groups.k.scale[i], groups.k.min[i]
        pool.v_codes[slot], pool.v_scale[slot], pool.v_min[slot] = groups.v.codes[i], groups.v.scale[i], groups.v.min[i]
    seg = launch.QuantSegment(pool.k_codes, pool.k_scale, pool.k_min, pool.v_codes, pool.v_scale, pool.v_min,
                              group_table=order.to(torch.int32)[None], positions=groups.positions[None],
                              n_groups=torch.tensor([3], dtype=torch.int32), bits=bits, group_size=g)
    from localctx.kernels_cuda.quant_attention import full_segment

    qr = rope.rotate(q[None], q_pos[None])
    out, _ = launch.run_attention(launch.Queries(qr, q_pos[None]), full_segment(full, q.dtype), seg,
                                  inv_freq=rope.inv_freq, scale=D ** -0.5, config=launch.LaunchConfig(splits=2))
    torch.testing.assert_close(out[0], attend_ref(q, q_pos, full, groups, rope).out, atol=ATOL, rtol=1e-3)


def paged_inputs(seed, *, D, Hq, Hkv, bs, lengths, T):
    """A pool with blocks handed out interleaved between sequences; queries are each
    sequence's last T tokens."""
    torch.manual_seed(seed)
    n_blocks = sum(-(-n // bs) for n in lengths) + 2
    k_blocks, v_blocks = torch.randn(n_blocks, bs, Hkv, D), torch.randn(n_blocks, bs, Hkv, D)
    perm = torch.randperm(n_blocks).tolist()
    width = max(-(-n // bs) for n in lengths)
    tables = []
    for n in lengths:
        own = [perm.pop() for _ in range(-(-n // bs))]
        tables.append(own + [0] * (width - len(own)))
    q = torch.randn(len(lengths), T, Hq, D)
    q_pos = torch.stack([torch.arange(n - T, n) for n in lengths])
    return q, k_blocks, v_blocks, torch.tensor(tables), q_pos


PAGED_CASES = [  # D, Hq, Hkv, block size, lengths, T, sinks, window, keys before RoPE
    pytest.param(64, 6, 2, 16, (37, 20), 1, 0, None, False, id="d64-bs16-gqa3"),
    pytest.param(128, 4, 4, 5, (23, 9), 2, 0, None, True, id="d128-bs5-mha-rope"),
    pytest.param(64, 8, 2, 8, (41, 30), 1, 3, 10, False, id="d64-bs8-sink3-win10"),
    pytest.param(128, 2, 1, 16, (33,), 3, 0, 6, True, id="d128-bs16-win6-rope-prefill"),
]


@pytest.mark.parametrize("D,Hq,Hkv,bs,lengths,T,sinks,window,rope_keys", PAGED_CASES)
def test_paged_attention_matches_reference(D, Hq, Hkv, bs, lengths, T, sinks, window, rope_keys):
    q, kb, vb, tables, q_pos = paged_inputs(D + bs, D=D, Hq=Hq, Hkv=Hkv, bs=bs, lengths=lengths, T=T)
    rope = Rope(D, 10000.0) if rope_keys else None
    ref = paged_reference(q, kb, vb, tables, q_pos, key_rope=rope, sinks=sinks, window=window)
    got = paged_attention(q, kb, vb, tables, q_pos, key_rope=rope, sinks=sinks, window=window,
                          config=launch.LaunchConfig(splits=3, block_n=16))
    torch.testing.assert_close(got, ref, atol=ATOL if rope_keys else 1e-5, rtol=1e-3)


def test_window_mask_changes_the_result():
    q, kb, vb, tables, q_pos = paged_inputs(3, D=64, Hq=2, Hkv=1, bs=8, lengths=(30,), T=1)
    cfg = launch.LaunchConfig(splits=2, block_n=16)
    full = paged_attention(q, kb, vb, tables, q_pos, config=cfg)
    windowed = paged_attention(q, kb, vb, tables, q_pos, sinks=2, window=4, config=cfg)
    assert not torch.allclose(full, windowed, atol=1e-3)
    # only keys 0, 1 and 26..29 are visible: editing key 10 changes nothing
    kb2 = kb.clone()
    kb2[tables[0, 1], 2] += 3.0
    torch.testing.assert_close(paged_attention(q, kb2, vb, tables, q_pos, sinks=2, window=4, config=cfg), windowed)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("D,g", [(64, 32), (128, 64), (64, 64)])
def test_quantize_append_is_bit_exact(bits, D, g):
    torch.manual_seed(bits + D + g)
    G, H = 3, 2
    k, v = torch.randn(G, H, g, D) * 3, torch.randn(G, H, g, D)
    k[0, 0, :, 5] = 1.25  # a constant channel: zero scale
    v[1, 1, 3, :] = -0.5  # a constant token: zero scales
    slots = torch.tensor([4, 0, 2])
    want, got = QuantPool.empty(5, H, D, bits, g), QuantPool.empty(5, H, D, bits, g)
    quantize_append_reference(k, v, bits, g, want, slots)
    quantize_append(k, v, bits, g, got, slots)
    for name in ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    untouched = torch.tensor([1, 3])
    assert not got.k_codes[untouched].any() and not got.v_scale[untouched].any()


def test_quantize_append_refuses_a_wrong_group_shape():
    pool = QuantPool.empty(1, 1, 64, 4, 32)
    with pytest.raises(ValueError, match="group"):
        quantize_append(torch.randn(1, 1, 16, 64), torch.randn(1, 1, 16, 64), 4, 32, pool, torch.tensor([0]))
