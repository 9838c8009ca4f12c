"""The Metal kernels against their pure-MLX references (never kernel against kernel). They run
only where Apple Metal exists; the references are tested everywhere (test_mlx_kernel_refs.py)."""
import math

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the Metal kernels need mlx")

from localctx.kernels_metal import decode_attention as da  # noqa: E402
from localctx.kernels_metal import quant_append as qa  # noqa: E402
from localctx.kernels_metal.quant import QuantFormat, dequantize_keys, dequantize_values, unpack  # noqa: E402
from localctx.kernels_metal.rope import inv_frequencies  # noqa: E402

from test_mlx_kernel_refs import random_kv  # noqa: E402

pytestmark = [
    pytest.mark.metal,
    pytest.mark.skipif(not (da.KERNEL_AVAILABLE and qa.KERNEL_AVAILABLE),
                       reason="Apple Metal is not available here (mx.metal.is_available() is False); "
                              "the pure-MLX references are tested in test_mlx_kernel_refs.py"),
]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sinks,window", [(0, 0), (4, 50)])
@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("n_groups,n_full", [(0, 5), (3, 1), (5, 37)])  # totals 5, 97, 197: not block multiples
def test_decode_kernel_matches_reference(d, ratio, bits, sinks, window, traditional, n_groups, n_full):
    q, kv, fmt = random_kv(d, ratio, bits, n_quant_groups=n_groups, n_full=n_full, seed=d * ratio + bits)
    n = kv.n_quantized + kv.n_full
    p = da.DecodeParams(fmt, q_position=n - 1, scale=1 / math.sqrt(d), traditional=traditional, sinks=sinks,
                        window=window)
    inv = inv_frequencies(d, 10000.0)
    got = da.decode_attention_metal(q, kv, inv, p)
    want = da.decode_attention_reference(q, kv, inv, p)
    np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.array(got[1]), np.array(want[1]), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.array(got[2]), np.array(want[2]), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("n_groups", [1, 3])
def test_quantize_append_kernel_matches_reference(d, bits, group, n_groups):
    rng = np.random.default_rng(d + bits + group)
    fmt = QuantFormat(bits, group)
    k = mx.array(rng.standard_normal((3, n_groups * group, d)).astype(np.float16))
    v = mx.array(rng.standard_normal((3, n_groups * group, d)).astype(np.float16))
    start = qa.quantize_append_reference(qa.QuantStore.empty(3, d, fmt), k, v, fmt)
    got = qa.quantize_append_metal(start, k, v, fmt)
    want = qa.quantize_append_reference(start, k, v, fmt)
    for a, b in zip(got.arrays()[1:3] + got.arrays()[4:], want.arrays()[1:3] + want.arrays()[4:]):
        np.testing.assert_array_equal(np.array(a), np.array(b))  # scales and mins: same fp16 arithmetic
    # codes may differ by one step where a value sits on a rounding tie; dequantised they agree
    for deq, parts in ((dequantize_keys, (0, 1, 2)), (dequantize_values, (3, 4, 5))):
        x = deq(*(got.arrays()[i] for i in parts), fmt)
        y = deq(*(want.arrays()[i] for i in parts), fmt)
        step = np.array(got.arrays()[parts[1]], dtype=np.float32).max()
        assert np.abs(np.array(x) - np.array(y)).max() <= step + 1e-6
    codes_diff = np.array(unpack(got.k_codes, bits)).astype(int) - np.array(unpack(want.k_codes, bits)).astype(int)
    assert np.mean(codes_diff != 0) < 1e-3
