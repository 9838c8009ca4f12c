"""The kernels behind the caches' seams: dispatch, and whole streams through the policy cache
and the paged cache with the (interpreted) kernels against the reference path."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # set by the process that runs these, never in-process
    pytest.skip("the Triton interpreter tests run in their own process (tests/kernels_cuda/test_triton_interpreter.py)",
                allow_module_level=True)

import torch

from localctx.backends.torch.rope import Rope
from localctx.kernels_cuda import dispatch
from localctx.kvcache.paged_attention import paged_attention as paged_reference
from localctx.kvcache.paged import CacheShape, PagedKVCache
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache
from localctx.kvcache.quant_attention import attend_reference

needs_triton = pytest.mark.skipif(not dispatch.triton_importable(), reason="Triton is not installed")


def test_cpu_tensors_take_the_references_by_default(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert not dispatch.uses_kernels("cpu")
    assert dispatch.policy_attention("cpu") is attend_reference
    assert dispatch.paged_attention("cpu") is paged_reference
    assert dispatch.quantize_groups("cpu") is dispatch.quantize_groups_reference


def test_off_forces_the_references_even_on_cuda(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "off")
    assert not dispatch.uses_kernels("cuda")
    assert dispatch.policy_attention("cuda") is attend_reference


@needs_triton
def test_cuda_tensors_take_the_kernels(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert dispatch.uses_kernels("cuda")
    monkeypatch.setenv(dispatch.ENV, "interpret")
    assert dispatch.uses_kernels("cpu")
    assert dispatch.policy_attention("cpu") is not attend_reference


def test_a_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(ValueError, match="LOCALCTX_TRITON='fast'.*auto, interpret, off"):
        dispatch.mode()


def test_kernel_shapes():
    assert dispatch.kernel_supports(64) and dispatch.kernel_supports(128)
    assert not dispatch.kernel_supports(96) and not dispatch.kernel_supports(16)


@needs_triton
def test_unsupported_head_dim_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "interpret")
    from localctx.kvcache.quant_attention import FullTokens

    torch.manual_seed(0)
    D = 48  # not a power of two: the kernel cannot tile it
    full = FullTokens(torch.randn(1, 5, D), torch.randn(1, 5, D), torch.arange(5))
    q, q_pos, rope = torch.randn(1, 2, D), torch.tensor([4]), Rope(D, 10000.0)
    got = dispatch.policy_attention("cpu")(q, q_pos, full, None, rope)
    torch.testing.assert_close(got.out, attend_reference(q, q_pos, full, None, rope).out)


def _stream(cache, n_layers: int, chunks: list[int], Hq: int, Hkv: int, D: int, seed: int) -> list[torch.Tensor]:
    """Feeds random pre-RoPE q/k/v through the cache's seam; returns every layer's output."""
    gen = torch.Generator().manual_seed(seed)
    outs = []
    cache.add_sequence(0)
    for T in chunks:
        cache.begin_step([0], T)
        for layer in range(n_layers):
            q = torch.randn(1, T, Hq, D, generator=gen)
            k = torch.randn(1, T, Hkv, D, generator=gen) * 2
            v = torch.randn(1, T, Hkv, D, generator=gen)
            outs.append(cache.attend(layer, q, k, v))
        cache.end_step()
    return outs


POLICIES = ["int4+sink4+win48", "int8+res8+win40+heavy32", "int4+g64", "fp16+sink2+win16+heavy8"]


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("policy_text", POLICIES)
def test_policy_cache_stream_matches_reference(monkeypatch, policy_text):
    """Prefill then chunked decode through quantization, eviction and heavy hitters: the
    kernel path produces the reference path's outputs and holds the same tokens and bytes."""
    monkeypatch.setenv(dispatch.ENV, "interpret")
    policy = KVPolicy.parse(policy_text)
    D, Hq, Hkv, layers = 64, 4, 2, 1
    shape = PolicyCacheShape(n_layers=layers, n_kv_heads=Hkv, head_dim=D)
    rope = Rope(D, 10000.0)
    chunks = [40] + [16] * 4 + [1, 1]  # 106 tokens: past every window, two groups out of it
    ref = PolicyKVCache(shape, policy, rope)
    fused = PolicyKVCache(shape, policy, rope, attention=dispatch.policy_attention("cpu"),
                          quantize_groups=dispatch.quantize_groups("cpu"))
    want = _stream(ref, layers, chunks, Hq, Hkv, D, seed=5)
    got = _stream(fused, layers, chunks, Hq, Hkv, D, seed=5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert fused.kv_bytes() == ref.kv_bytes() and fused.kv_tokens() == ref.kv_tokens()
    assert fused.evicted_tokens() == ref.evicted_tokens()
    if policy.window is not None:
        assert ref.evicted_tokens() > 0  # the stream did run past the window


@needs_triton
def test_paged_cache_stream_matches_reference(monkeypatch):
    """Two sequences in one block pool (batched decode after separate prefills)."""
    monkeypatch.setenv(dispatch.ENV, "interpret")
    D, Hq, Hkv = 64, 6, 2
    shape = CacheShape.for_tokens(96, n_layers=1, n_kv_heads=Hkv, head_dim=D, block_size=8)
    rope = Rope(D, 10000.0)
    caches = [PagedKVCache(shape, rope), PagedKVCache(shape, rope, attention=dispatch.paged_attention("cpu"))]
    outs = []
    for cache in caches:
        gen = torch.Generator().manual_seed(3)
        rand = lambda *s: torch.randn(*s, generator=gen)
        got = []
        for seq, n in ((0, 13), (1, 21)):
            cache.add_sequence(seq)
            cache.begin_step([seq], n)
            got.append(cache.attend(0, rand(1, n, Hq, D), rand(1, n, Hkv, D), rand(1, n, Hkv, D)))
            cache.end_step()
        for _ in range(3):
            cache.begin_step([0, 1], 1)
            got.append(cache.attend(0, rand(2, 1, Hq, D), rand(2, 1, Hkv, D), rand(2, 1, Hkv, D)))
            cache.end_step()
        outs.append(got)
    for a, b in zip(outs[1], outs[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _bench_module():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_check" / "attention_bench.py"
    spec = importlib.util.spec_from_file_location("cuda_attention_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_refuses_to_run_without_a_gpu(capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    assert _bench_module().main(["--contexts", "4096"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


@needs_triton
def test_gpu_benchmark_variants_compute_the_reference_result(monkeypatch):
    """The benchmark's inputs and calls, on CPU through the interpreter: every timed variant
    returns what its reference returns (so a GPU run times correct kernels)."""
    monkeypatch.setenv(dispatch.ENV, "interpret")
    bench = _bench_module()
    args = bench.parse_args(["--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--residual", "16"])
    rope = Rope(64, 500000.0)
    torch.manual_seed(0)
    case = bench.build_case(112, args, rope, "cpu", torch.float32)
    variants = bench.variants(case, args, rope)
    assert [v.name for v in variants] == ["fp16-sdpa", "fp16-triton", "int8", "int4"]
    for var in variants:
        assert var.check() < 1e-3, var.name
    fp16_bytes, int8, int4 = variants[0].bytes_read, variants[2].bytes_read, variants[3].bytes_read
    assert fp16_bytes == 2 * 2 * 112 * 64 * 4  # K and V, fp32 here
    assert int4 < int8 < fp16_bytes
