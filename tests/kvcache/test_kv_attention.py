import pytest
import torch

from localctx.kvcache import quant
from localctx.kvcache.quant_attention import FullTokens, QuantGroups, attend_reference

from kv_helpers import PlainRope

H, HKV, D = 6, 2, 64


def naive(q, q_pos, k, v, k_pos, rope):
    """Softmax attention written out per head, keys rotated at their positions."""
    qr = rope.rotate(q.unsqueeze(0), q_pos.unsqueeze(0))[0]
    kr = rope.rotate(k.transpose(0, 1).unsqueeze(0), k_pos.unsqueeze(0))[0]  # [L, Hkv, D]
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        kv_h = h // (q.shape[1] // k.shape[0])
        s = qr[:, h] @ kr[:, kv_h].T / D ** 0.5
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[:, h] = s.softmax(-1) @ v[kv_h]
    return out


def make_groups(k, v, bits, g, positions):
    """k, v: [Hkv, G*g, D] → QuantGroups of G groups."""
    G = k.shape[1] // g
    ks = [quant.quantize_keys(k[:, i * g:(i + 1) * g], bits) for i in range(G)]
    vs = [quant.quantize_values(v[:, i * g:(i + 1) * g], bits, g) for i in range(G)]
    stack = lambda qs: quant.QuantizedTensor(torch.stack([x.codes for x in qs]), torch.stack([x.scale for x in qs]),
                                             torch.stack([x.min for x in qs]), bits)
    return QuantGroups(stack(ks), stack(vs), positions.reshape(G, g), g)


@pytest.mark.parametrize("want_mass", [False, True])
def test_full_precision_matches_naive_attention_at_in_cache_positions(want_mass):
    torch.manual_seed(0)
    rope = PlainRope(D)
    L, T = 20, 4
    k, v = torch.randn(HKV, L, D), torch.randn(HKV, L, D)
    pos = torch.arange(L)
    q = torch.randn(T, H, D)
    q_pos = torch.arange(L - T, L)
    res = attend_reference(q, q_pos, FullTokens(k, v, pos), None, rope, want_mass=want_mass)
    assert torch.allclose(res.out, naive(q, q_pos, k, v, pos, rope), atol=1e-5)
    if want_mass:
        assert res.full_mass.shape == (L,)
        assert torch.allclose(res.full_mass.sum(), torch.tensor(float(T * H)), atol=1e-4)
        assert torch.all(res.full_mass[-1:] > 0)


def test_attention_depends_only_on_relative_positions():
    torch.manual_seed(1)
    rope = PlainRope(D)
    k, v, q = torch.randn(HKV, 8, D), torch.randn(HKV, 8, D), torch.randn(1, H, D)
    near = attend_reference(q, torch.tensor([7]), FullTokens(k, v, torch.arange(8)), None, rope).out
    far = attend_reference(q, torch.tensor([5007]), FullTokens(k, v, torch.arange(5000, 5008)), None, rope).out
    assert torch.allclose(near, far, atol=1e-4)


@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.25)])
@pytest.mark.parametrize("g", [32, 64])
def test_quantized_groups_plus_full_tail_approximate_full_precision(bits, tol, g):
    torch.manual_seed(2)
    rope = PlainRope(D)
    G, tail, T = 2, 5, 3
    L = G * g + tail
    k, v = torch.randn(HKV, L, D), torch.randn(HKV, L, D)
    pos = torch.arange(L)
    q = torch.randn(T, H, D)
    q_pos = torch.arange(L - T, L)
    exact = naive(q, q_pos, k, v, pos, rope)
    groups = make_groups(k[:, :G * g], v[:, :G * g], bits, g, pos[:G * g])
    full = FullTokens(k[:, G * g:], v[:, G * g:], pos[G * g:])
    for want_mass in (False, True):
        res = attend_reference(q, q_pos, full, groups, rope, want_mass=want_mass)
        err = (res.out - exact).abs().max()
        assert 0 < err < tol
    assert res.quant_mass.shape == (G, g) and res.full_mass.shape == (tail,)
    assert torch.allclose(res.quant_mass.sum() + res.full_mass.sum(), torch.tensor(float(T * H)), atol=1e-3)


def test_dequantized_groups_are_exactly_what_attention_sees():
    torch.manual_seed(3)
    rope = PlainRope(D)
    g = 32
    k, v = torch.randn(HKV, g, D), torch.randn(HKV, g, D)
    groups = make_groups(k, v, 4, g, torch.arange(g))
    kd = quant.dequantize_keys(groups.k)[0]
    vd = quant.dequantize_values(groups.v, g)[0]
    q, q_pos = torch.randn(2, H, D), torch.tensor([g, g + 1])
    empty = FullTokens(torch.zeros(HKV, 0, D), torch.zeros(HKV, 0, D), torch.zeros(0, dtype=torch.long))
    res = attend_reference(q, q_pos, empty, groups, rope)
    assert torch.allclose(res.out, naive(q, q_pos, kd, vd, torch.arange(g), rope), atol=1e-5)
