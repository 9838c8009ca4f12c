"""Keys and values at different precisions (k8v4, kf16v8, kf16v4): the cost model's bytes per
side, the kernels that read one precision handing a split to the reference, and each backend's
answer for a split (its cache types, or its refusal with the reason)."""
from __future__ import annotations

import pytest
import torch

from localctx.backends.torch.rope import Rope
from localctx.kvcache import cost, quant
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.quant_attention import FullTokens, QuantGroups, attend_reference
from localctx.kvcache.model_spec import ModelSpec
from kv_helpers import attend_step, random_steps

SPEC = ModelSpec("tiny", "llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, hidden_size=256,
                 vocab_size=64, context_length=4096, kv_elem_bytes=2)


@pytest.mark.parametrize("text, k_token, v_token", [
    ("k8v4", 128 + 4 * 4, 64 + 4 * 4), ("kf16v8", 128 * 2, 128 + 4 * 4), ("kf16v4", 128 * 2, 64 + 4 * 4),
    ("k4v8+g64", 64 + 2 * 4, 128 + 2 * 4), ("int8", 128 + 4 * 4, 128 + 4 * 4)])
def test_a_quantized_token_costs_each_side_at_its_own_precision(text, k_token, v_token):
    """Per layer: K and V are 2 heads × 64 wide; a quantized side packs its bits plus an fp16 scale
    and min per group, a side at 16 bits keeps the model's 2 bytes an element."""
    policy = KVPolicy.parse(text)
    assert cost.kv_bytes_per_token(SPEC, policy) == 2 * (k_token + v_token)
    n = 1000  # the 32-token head and the rest quantized in groups of g (no residual)
    g = policy.group_size
    quantized = (n - g) // g * g
    full = n - quantized
    assert cost.kv_bytes(SPEC, policy, n) == quantized * 2 * (k_token + v_token) + full * 2 * 256 * 2


def split_groups(k_bits: int, v_bits: int, G=2, H=2, g=32, D=64, seed=0) -> QuantGroups:
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(G, H, g, D, generator=gen), torch.randn(G, H, g, D, generator=gen)
    qk = quant.FullGroups(k) if k_bits == 16 else quant.quantize_keys(k, k_bits)
    qv = quant.FullGroups(v) if v_bits == 16 else quant.quantize_values(v, v_bits, g)
    return QuantGroups(qk, qv, torch.arange(G * g).reshape(G, g), g)


def test_the_triton_policy_attention_hands_a_split_to_the_reference(monkeypatch):
    pytest.importorskip("triton", reason="Triton is not installed")
    from localctx.kernels_cuda import quant_attention as kernel

    groups = split_groups(16, 4)
    assert groups.uniform_bits is None and split_groups(8, 8).uniform_bits == 8
    gen = torch.Generator().manual_seed(1)
    full = FullTokens(torch.randn(2, 5, 64, generator=gen), torch.randn(2, 5, 64, generator=gen), torch.arange(64, 69))
    q, q_pos, rope = torch.randn(1, 4, 64, generator=gen), torch.tensor([68]), Rope(64, 10000.0)
    monkeypatch.setattr(kernel, "run_attention", lambda *a, **k: pytest.fail("the kernel was launched for a split"))
    got = kernel.attend(q, q_pos, full, groups, rope)
    torch.testing.assert_close(got.out, attend_reference(q, q_pos, full, groups, rope).out, atol=0, rtol=0)


def test_llama_cpp_describes_its_own_cache_types_and_padding():
    from localctx.backends.llamacpp.backend import LlamaCppBackend

    describe = LlamaCppBackend().describe_kv
    blocks = ("blocks of 32 along the head dimension, one fp16 scale a block, for every token; "
              "no full-precision head or residual, no per-channel key groups); cache padded to a multiple of 256 cells")
    assert describe(KVPolicy.parse("int8")) == f"lossy: q8_0 keys and values (8-bit {blocks}"
    assert describe(KVPolicy.parse("k8v4")) == f"lossy: q8_0 keys, q4_0 values (8-bit and 4-bit {blocks}"
    assert describe(KVPolicy.parse("kf16v4")) == f"lossy: f16 keys, q4_0 values (4-bit {blocks}"
    assert describe(KVPolicy.parse("fp16")) == "exact: f16 keys and values; cache padded to a multiple of 256 cells"
    assert describe(KVPolicy.parse("kf16v8+sink4+win4096")).endswith(
        "keeps first 4 + last 3840–4096 tokens (llama.cpp's context shift evicts 256 at a time)")


def test_the_policy_cache_backends_describe_groups_head_and_residual():
    from localctx.backends.torch.backend import TorchBackend

    assert TorchBackend().describe_kv(KVPolicy.parse("kf16v4+res128")) == \
        "lossy: full-precision keys, 4-bit values (groups of 32, first 32 and last 128 tokens full precision)"


@pytest.mark.parametrize("backend, start", [("llamacpp", "lossy: q8_0 keys, q4_0 values"),
                                            ("torch", "lossy: 8-bit keys, 4-bit values (groups of 32")])
def test_a_plan_carries_its_backends_description(backend, start):
    from localctx.backends.machine.planner_inputs import planning_context, plan_fixed
    from localctx.kvcache.planner import PlanRequest

    ctx = planning_context(backend, SPEC, hardware="cpu-24gb", measure=False)
    plan = plan_fixed(ctx, SPEC, KVPolicy.parse("k8v4"), PlanRequest(context=1000))
    assert plan.kv_layout.startswith(start) and plan.to_dict()["kv_layout"] == plan.kv_layout
    assert any(start in reason for reason in plan.reasons)


def test_llama_cpp_shifts_a_window_with_quantized_values_but_not_quantized_keys():
    from localctx.backends.llamacpp.backend import LlamaCppBackend

    backend = LlamaCppBackend()
    for ok in ("kf16v8+sink4+win1024", "kf16v4+sink4+win1024", "k8v4", "kf16v4"):
        assert backend.refusals(KVPolicy.parse(ok), SPEC) == [], ok
    for refused in ("k8v4+sink4+win1024", "int8+sink4+win1024", "k8vf16+sink4+win1024"):
        (reason,) = backend.refusals(KVPolicy.parse(refused), SPEC)
        assert "requantise the quantized K cache" in reason and "kf16v8+sink4+win4096" in reason


def test_the_mlx_cache_refuses_a_split_with_the_reason():
    pytest.importorskip("mlx.core", reason="MLX is not installed")
    from localctx.backends import registry

    (reason,) = registry.backend_class("mlx")().refusals(KVPolicy.parse("kf16v4"), SPEC)
    assert reason.startswith("keys and values at different precisions (kf16v4) are not supported")
    assert registry.backend_class("mlx")().refusals(KVPolicy.parse("int4"), SPEC) == []


@pytest.mark.slow
def test_a_llama_cpp_window_with_quantized_values_streams_through_the_shift(smollm2_path, cli):
    """SmolLM2 on llama.cpp, f16 keys and q8_0 values: a 300-token prompt through a 128-token window."""
    import json

    prompt = " ".join(["the river carried seven stones past the mill"] * 34)
    res = cli("run", "-m", str(smollm2_path), "--backend", "llamacpp", "--kv", "kf16v8+sink4+win128",
              "--max-tokens", "8", "--raw", "--json", prompt)
    assert res.code == 0, res.err
    out = json.loads(res.out)
    assert out["stats"]["evicted_tokens"] > 0 and out["stats"]["generated_tokens"] == 8
    assert out["kv_layout"].startswith("lossy: f16 keys, q8_0 values")


@pytest.mark.parametrize("text", ["k8v4", "kf16v4+res16", "k4vf16+sink2+win64+heavy8"])
def test_a_split_cache_exports_and_imports_what_it_holds(text):
    """A prompt-cache file of a split policy: each side's own rows (codes and scales, or full rows)."""
    from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache

    L, H, HKV, D = 2, 4, 2, 64
    policy, rope = KVPolicy.parse(text), Rope(D, 10000.0)
    shape = PolicyCacheShape(L, HKV, D, torch.float32)
    source, copy = PolicyKVCache(shape, policy, rope), PolicyKVCache(shape, policy, rope)
    step, run = random_steps(5, L, H, HKV, D), attend_step
    source.add_sequence(0)
    for T in (70, 1, 40, 1):
        run(source, step(T))
    tensors = source.export_sequence(0)
    side_rows = {"qk_codes", "qk_full", "qv_codes", "qv_full"} & set(tensors)
    assert side_rows == {"qk_full" if policy.k_bits == 16 else "qk_codes", "qv_full" if policy.v_bits == 16 else "qv_codes"}
    copy.import_sequence(0, tensors)
    assert copy.kv_bytes(0) == source.kv_bytes(0) == cost.kv_bytes(
        ModelSpec("t", "llama", n_layers=L, n_heads=H, n_kv_heads=HKV, head_dim=D, hidden_size=H * D, vocab_size=8,
                  context_length=4096, kv_elem_bytes=4), policy, 112)
    nxt = step(1)
    for a, b in zip(run(source, nxt), run(copy, nxt)):
        assert torch.equal(a, b)
