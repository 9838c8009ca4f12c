"""The pure-MLX kernel references (run everywhere) against plain numpy: dense attention over
dequantised K/V, RoPE at in-cache positions, group-wise affine quantization."""
import math

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX kernels' references need mlx (pip install 'mlx[cpu]')")

from localctx.kernels_metal.decode_attention import (DecodeParams, QuantizedKV,  # noqa: E402
                                                     decode_attention_reference)
from localctx.kernels_metal.quant import QuantFormat, pack, unpack  # noqa: E402
from localctx.kernels_metal.quant_append import QuantStore, quantize_append_reference  # noqa: E402
from localctx.kernels_metal.rope import inv_frequencies, rope_at  # noqa: E402

SHAPES = [(64, 1), (64, 3), (128, 4), (128, 8), (64, 8), (128, 1)]  # (head dim, GQA ratio)
MASKS = [(0, 0), (4, 20)]  # (sinks, window); window 0 = off


def random_kv(d: int, ratio: int, bits: int, n_quant_groups: int, n_full: int, seed: int = 0,
              group: int = 32, n_kv: int = 2):
    """Random q and a QuantizedKV with random codes; slot positions are a shuffled permutation
    (slots need not be in stream order)."""
    rng = np.random.default_rng(seed)
    fmt = QuantFormat(bits, group)
    nq = n_quant_groups * group
    codes = rng.integers(0, 2 ** bits, size=(2, n_kv, nq, d), dtype=np.uint32)
    kv = QuantizedKV(
        k_codes=pack(mx.array(codes[0]), bits), v_codes=pack(mx.array(codes[1]), bits),
        k_scales=mx.array(rng.uniform(0.01, 0.1, (n_kv, n_quant_groups, d)).astype(np.float16)),
        k_mins=mx.array(rng.uniform(-1, 0, (n_kv, n_quant_groups, d)).astype(np.float16)),
        v_scales=mx.array(rng.uniform(0.01, 0.1, (n_kv, nq, d // group)).astype(np.float16)),
        v_mins=mx.array(rng.uniform(-1, 0, (n_kv, nq, d // group)).astype(np.float16)),
        k_full=mx.array(rng.standard_normal((n_kv, n_full, d)).astype(np.float16)),
        v_full=mx.array(rng.standard_normal((n_kv, n_full, d)).astype(np.float16)),
        positions=mx.array(rng.permutation(nq + n_full).astype(np.int32)))
    q = mx.array(rng.standard_normal((n_kv * ratio, d)).astype(np.float32))
    return q, kv, fmt


def numpy_dense_attention(q, kv: QuantizedKV, fmt: QuantFormat, p: DecodeParams, base: float):
    """Dequantise with numpy bit ops, rotate with numpy, attend densely."""
    g, bits = fmt.group_size, fmt.bits
    per_word = 32 // bits

    def codes(words):
        w = np.array(words)
        shifts = np.arange(per_word, dtype=np.uint32) * bits
        return ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], -1).astype(np.float64)

    keys, values = [np.array(kv.k_full, dtype=np.float64)], [np.array(kv.v_full, dtype=np.float64)]
    if kv.n_quantized:
        kc, vc = codes(kv.k_codes), codes(kv.v_codes)
        ks = np.repeat(np.array(kv.k_scales, dtype=np.float64), g, axis=1)
        km = np.repeat(np.array(kv.k_mins, dtype=np.float64), g, axis=1)
        vs = np.repeat(np.array(kv.v_scales, dtype=np.float64), g, axis=2)
        vm = np.repeat(np.array(kv.v_mins, dtype=np.float64), g, axis=2)
        keys.insert(0, kc * ks + km)
        values.insert(0, vc * vs + vm)
    k, v = np.concatenate(keys, 1), np.concatenate(values, 1)
    d = k.shape[-1]
    pos = np.array(kv.positions)
    inv = base ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    if p.traditional:
        a, b = k[..., 0::2], k[..., 1::2]
        rot = np.empty_like(k)
        rot[..., 0::2], rot[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = k[..., : d // 2], k[..., d // 2:]
        rot = np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)
    qn = np.array(q, dtype=np.float64)
    rep = qn.shape[0] // k.shape[0]
    outs = []
    visible = (pos <= p.q_position) & ((p.window == 0) | (pos < p.sinks) | (p.q_position - pos < p.window))
    for h in range(qn.shape[0]):
        s = rot[h // rep] @ qn[h] * p.scale
        s = np.where(visible, s, -np.inf)
        w = np.exp(s - s.max())
        outs.append((w / w.sum()) @ v[h // rep])
    return np.stack(outs)


@pytest.mark.parametrize("d,ratio", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sinks,window", MASKS)
@pytest.mark.parametrize("traditional", [True, False])
def test_decode_reference_matches_dense_attention(d, ratio, bits, sinks, window, traditional):
    q, kv, fmt = random_kv(d, ratio, bits, n_quant_groups=2, n_full=13, seed=d + ratio + bits)
    n = kv.n_quantized + kv.n_full  # 77: not a multiple of the group or of a block
    p = DecodeParams(fmt, q_position=n - 1, scale=1 / math.sqrt(d), traditional=traditional, sinks=sinks,
                     window=window)
    out, scores, lse = decode_attention_reference(q, kv, inv_frequencies(d, 10000.0), p)
    want = numpy_dense_attention(q, kv, fmt, p, 10000.0)
    np.testing.assert_allclose(np.array(out), want, atol=2e-4, rtol=2e-3)
    weights = np.exp(np.array(scores) - np.array(lse)[:, None])
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-4)
    if window:
        hidden = np.array(kv.positions) >= sinks
        hidden &= (n - 1 - np.array(kv.positions)) >= window
        assert np.all(np.isneginf(np.array(scores)[:, hidden]))


def test_decode_reference_with_only_full_precision_tokens():
    q, kv, fmt = random_kv(64, 3, 4, n_quant_groups=0, n_full=7)
    p = DecodeParams(fmt, q_position=6, scale=0.125, traditional=True)
    out, _s, _l = decode_attention_reference(q, kv, inv_frequencies(64, 10000.0), p)
    np.testing.assert_allclose(np.array(out), numpy_dense_attention(q, kv, fmt, p, 10000.0), atol=2e-4)


@pytest.mark.parametrize("traditional", [True, False])
def test_rope_at_matches_mlx_fast_rope(traditional):
    x = mx.random.normal((2, 9, 64), key=mx.random.key(1))
    want = mx.fast.rope(x[None], 64, traditional=traditional, base=10000.0, scale=1.0, offset=5)[0]
    got = rope_at(x, mx.arange(5, 14), inv_frequencies(64, 10000.0), traditional)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits):
    codes = mx.array(np.random.default_rng(0).integers(0, 2 ** bits, (3, 5, 64)).astype(np.uint32))
    words = pack(codes, bits)
    assert words.shape == (3, 5, 64 * bits // 32)
    np.testing.assert_array_equal(np.array(unpack(words, bits)), np.array(codes))


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 64), (8, 64)])
@pytest.mark.parametrize("d", [64, 128])
def test_quantize_append_reference_groups_keys_per_channel_values_per_token(bits, group, d):
    rng = np.random.default_rng(bits + group)
    fmt = QuantFormat(bits, group)
    k = rng.standard_normal((2, 2 * group, d)).astype(np.float32)
    k[:, :, 5] *= 30  # an outlier channel: per-channel key groups keep it from hurting the others
    v = rng.standard_normal((2, 2 * group, d)).astype(np.float32)
    store = quantize_append_reference(QuantStore.empty(2, d, fmt), mx.array(k), mx.array(v), fmt)
    store = quantize_append_reference(store, mx.array(k), mx.array(v), fmt)
    assert store.n_tokens == 4 * group
    assert store.k_scales.shape == (2, 4, d) and store.v_scales.shape == (2, 4 * group, d // group)
    levels = 2 ** bits - 1
    kg = k.reshape(2, 2, group, d)  # numpy: per channel over each group of tokens
    lo, hi = kg.min(2), kg.max(2)
    np.testing.assert_allclose(np.array(store.k_mins[:, :2], dtype=np.float32), lo, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.array(store.k_scales[:, :2], dtype=np.float32), (hi - lo) / levels, rtol=1e-3)
    vg = v.reshape(2, 2 * group, d // group, group)  # per token over each group of channels
    np.testing.assert_allclose(np.array(store.v_mins[:, :2 * group], dtype=np.float32), vg.min(-1), rtol=2e-3, atol=1e-3)
    kcodes = np.array(unpack(store.k_codes[:, :2 * group], bits)).reshape(2, 2, group, d)
    kdeq = kcodes * np.array(store.k_scales[:, :2], dtype=np.float32)[:, :, None] + \
        np.array(store.k_mins[:, :2], dtype=np.float32)[:, :, None]
    step = ((hi - lo) / levels)[:, :, None]
    assert np.all(np.abs(kdeq - kg) <= step * 0.5 + 2e-3 * (np.abs(kg) + 1))
    ok = np.delete(np.arange(d), 5)
    assert np.abs(kdeq - kg)[..., ok].max() < 0.6 * (2 ** (8 - bits)) / 16  # outlier stayed in its channel


def test_quantize_append_refuses_partial_groups():
    fmt = QuantFormat(4, 32)
    with pytest.raises(ValueError, match="whole groups"):
        quantize_append_reference(QuantStore.empty(2, 64, fmt), mx.zeros((2, 31, 64)), mx.zeros((2, 31, 64)), fmt)


def test_constant_group_dequantises_exactly():
    fmt = QuantFormat(4, 32)
    k = mx.full((1, 32, 64), 0.75)
    store = quantize_append_reference(QuantStore.empty(1, 64, fmt), k, k, fmt)
    from localctx.kernels_metal.quant import dequantize_keys, dequantize_values
    np.testing.assert_array_equal(np.array(dequantize_keys(store.k_codes, store.k_scales, store.k_mins, fmt)), 0.75)
    np.testing.assert_array_equal(np.array(dequantize_values(store.v_codes, store.v_scales, store.v_mins, fmt)),
                                  0.75)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 64)])
def test_quantization_is_bit_identical_to_kvcache_quant(bits, group):
    """The MLX format is kvcache/quant.py's (the torch backend's): same codes, scales and mins,
    and the same bytes (uint32 words little-endian = its uint8 nibble packing)."""
    torch = pytest.importorskip("torch", reason="kvcache/quant.py is written in torch")
    from localctx.kvcache import quant as tq
    from localctx.kernels_metal.quant import quantize_keys, quantize_values
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((2, group, 64)).astype(np.float16)
    fmt = QuantFormat(bits, group)
    for ours, theirs in ((quantize_keys(mx.array(x), fmt), tq.quantize_keys(torch.from_numpy(x), bits)),
                         (quantize_values(mx.array(x), fmt), tq.quantize_values(torch.from_numpy(x), bits, group))):
        codes, scales, mins = ours
        np.testing.assert_array_equal(np.array(codes).view(np.uint8), theirs.codes.numpy())
        np.testing.assert_array_equal(np.array(scales).reshape(theirs.scale.shape), theirs.scale.numpy())
        np.testing.assert_array_equal(np.array(mins).reshape(theirs.min.shape), theirs.min.numpy())
