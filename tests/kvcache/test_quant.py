import pytest
import torch

from localctx.kvcache import quant
from localctx.kvcache.errors import UserError


def test_pack_and_unpack_are_inverse():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = quant.pack4(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(quant.unpack4(packed), codes)
    assert int(packed[0, 0, 0]) == int(codes[0, 0, 0]) | (int(codes[0, 0, 1]) << 4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_keys_round_trip_within_half_a_step_per_channel(bits, group):
    torch.manual_seed(0)
    k = torch.randn(3, group, 64) * 2
    q = quant.quantize_keys(k, bits)
    assert q.codes.shape == (3, group, 64 * bits // 8) and q.codes.dtype == torch.uint8
    assert q.scale.shape == (3, 1, 64) and q.scale.dtype == torch.float16
    back = quant.dequantize_keys(q)
    err = (back - k).abs()
    assert torch.all(err <= q.scale.float() / 2 + 1e-3)
    assert err.max() > 0  # it is lossy


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_values_round_trip_within_half_a_step_per_token(bits, group):
    torch.manual_seed(1)
    v = torch.randn(3, group, 64)
    q = quant.quantize_values(v, bits, group)
    assert q.scale.shape == (3, group, 64 // group)
    back = quant.dequantize_values(q, group)
    step = q.scale.float().repeat_interleave(group, dim=-1)
    assert torch.all((back - v).abs() <= step / 2 + 1e-3)


def test_eight_bits_is_much_closer_than_four():
    torch.manual_seed(2)
    v = torch.randn(2, 32, 64)
    e8 = (quant.dequantize_values(quant.quantize_values(v, 8, 32), 32) - v).abs().mean()
    e4 = (quant.dequantize_values(quant.quantize_values(v, 4, 32), 32) - v).abs().mean()
    assert e8 * 8 < e4


def test_per_channel_key_groups_isolate_an_outlier_channel():
    torch.manual_seed(3)
    k = torch.randn(1, 32, 64)
    k[..., 5] *= 100  # an outlier channel, as real keys have
    per_channel = quant.dequantize_keys(quant.quantize_keys(k, 4))
    per_token = quant.dequantize_values(quant.quantize_values(k, 4, 64), 64)
    others = [c for c in range(64) if c != 5]
    assert (per_channel - k)[..., others].abs().mean() * 5 < (per_token - k)[..., others].abs().mean()


def test_a_constant_group_is_exact():
    k = torch.full((2, 32, 64), 0.75)
    assert torch.equal(quant.dequantize_keys(quant.quantize_keys(k, 4)), k)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 64), (8, 64)])
def test_group_bytes_is_what_the_tensors_take(bits, group):
    k = quant.quantize_keys(torch.randn(3, group, 64), bits)
    v = quant.quantize_values(torch.randn(3, group, 64), bits, group)
    assert k.nbytes + v.nbytes == quant.group_bytes(3, 64, bits, group)


def test_head_dim_not_a_multiple_of_the_group_is_a_user_error():
    with pytest.raises(UserError, match="not a multiple"):
        quant.quantize_values(torch.randn(1, 64, 48), 8, 64)


def test_bits_other_than_4_or_8_are_refused():
    with pytest.raises(ValueError):
        quant.quantize_keys(torch.randn(1, 32, 64), 2)
