"""The torch backend's C kernel for policy-cache attention on a CPU, against the pure-torch
reference (kvcache/quant_attention.attend_reference) over several shapes, plus how it is built,
when it steps aside, and that a torch session uses it."""
from __future__ import annotations

import os
import platform
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.cpu_kernels import build
from localctx.backends.torch.cpu_kernels import policy_attention as cpu
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.backends.torch.rope import Rope
from localctx.kvcache import private_files, quant
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.quant_attention import FullTokens, QuantGroups, attend_reference
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

@pytest.fixture
def kernel():
    """The compiled kernel (built once per test process, into the test's own cache folder)."""
    if not cpu.available():
        pytest.skip(f"no CPU kernel here: {cpu.library().reason}")


@pytest.fixture
def fresh_build_state():
    build.load.cache_clear()  # this test sees the environment it sets, and the next ones theirs
    yield
    build.load.cache_clear()


def make_inputs(Hq, Hkv, D, G, g, bits, N, T, dtype=torch.float32, seed=0, hidden=0):
    """Random cache contents at scattered in-cache positions (as after eviction); the T queries sit
    ``hidden`` positions before the end, so the last keys are masked for them."""
    gen = torch.Generator().manual_seed(seed)
    L = G * g + N
    positions = torch.randperm(L, generator=gen)
    groups = None
    if G:
        k = torch.randn(G, Hkv, g, D, generator=gen) * 2 + 0.5
        v = torch.randn(G, Hkv, g, D, generator=gen)
        groups = QuantGroups(quant.quantize_keys(k, bits), quant.quantize_values(v, bits, g),
                             positions[:G * g].reshape(G, g), g)
    full = FullTokens(torch.randn(Hkv, N, D, generator=gen).to(dtype), torch.randn(Hkv, N, D, generator=gen).to(dtype),
                      positions[G * g:])
    q = torch.randn(T, Hq, D, generator=gen).to(dtype)
    q_pos = torch.arange(L - T - hidden, L - hidden)
    return q, q_pos, full, groups, Rope(D, 10000.0)


def as_float(full: FullTokens) -> FullTokens:
    return FullTokens(full.k.float(), full.v.float(), full.positions)


SHAPES = [  # Hq, Hkv, D, G, g, bits, N, T, hidden
    (9, 3, 64, 8, 32, 8, 20, 1, 0),  # SmolLM2's heads, int8, one decode token
    (9, 3, 64, 8, 32, 4, 20, 1, 0),
    (4, 4, 32, 3, 32, 4, 5, 3, 2),  # no GQA, several queries, keys past them masked; 4-bit unpacked bytewise
    (8, 2, 128, 4, 64, 8, 37, 2, 1),  # group of 64, a head dim with its own compiled copy
    (8, 2, 128, 3, 64, 4, 9, 1, 0),  # 4-bit keys unpacked in registers (head dims that are multiples of 64)
    (6, 2, 80, 2, 16, 8, 17, 1, 0),  # a head dim without one (the generic loop)
    (8, 2, 128, 0, 64, 8, 37, 2, 0),  # no quantized groups: a windowed fp16 cache
    (2, 1, 64, 1, 32, 4, 1, 1, 0),  # one group and the new token alone
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Hq{}-Hkv{}-D{}-G{}x{}-b{}-N{}-T{}-h{}".format(*s))
@pytest.mark.parametrize("want_mass", [False, True])
def test_kernel_matches_the_reference_in_float32(kernel, shape, want_mass):
    *dims, hidden = shape
    q, q_pos, full, groups, rope = make_inputs(*dims, hidden=hidden)
    ref = attend_reference(q, q_pos, full, groups, rope, want_mass=want_mass)
    got = cpu.attend(q, q_pos, full, groups, rope, want_mass=want_mass)
    assert got.out.dtype == q.dtype and got.out.shape == ref.out.shape
    torch.testing.assert_close(got.out, ref.out, atol=2e-5, rtol=1e-4)
    if want_mass:
        torch.testing.assert_close(got.full_mass, ref.full_mass, atol=2e-5, rtol=1e-4)
        if groups is None:
            assert got.quant_mass is None
        else:
            torch.testing.assert_close(got.quant_mass, ref.quant_mass, atol=2e-5, rtol=1e-4)
        assert float(got.full_mass.sum() + (got.quant_mass.sum() if groups else 0)) == pytest.approx(
            q.shape[0] * q.shape[1], rel=1e-5)  # every query's probabilities sum to one


def test_the_same_call_gives_the_same_bits_whatever_order_the_threads_finish_in(kernel):
    """Each thread sums its share of the values; those partial sums are added in thread order. Four
    threads on a busy 2-core machine finish in a different order from call to call, which an
    add-as-you-finish reduction turned into different last bits (a step rolled back and redone
    then differed from one never undone: tests/backends/torch/test_step_rollback.py)."""
    q, q_pos, full, groups, rope = make_inputs(9, 3, 64, 48, 32, 8, 200, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        outs = [cpu.attend(q, q_pos, full, groups, rope).out for _ in range(60)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_on_a_bf16_cache_matches_the_float32_reference(kernel, bits):
    # the kernel reads bf16 keys and values and computes in float32; the result is rounded to bf16 once
    q, q_pos, full, groups, rope = make_inputs(9, 3, 64, 6, 32, bits, 24, 1, dtype=torch.bfloat16)
    ref = attend_reference(q.float(), q_pos, as_float(full), groups, rope)
    got = cpu.attend(q, q_pos, full, groups, rope)
    assert got.out.dtype == torch.bfloat16
    torch.testing.assert_close(got.out.float(), ref.out, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("Hq,Hkv,D,T", [(9, 3, 64, 1), (9, 3, 64, 2), (8, 2, 128, 1), (5, 1, 32, 3), (12, 2, 64, 1)],
                         ids=lambda v: str(v))
def test_a_full_precision_window_matches_the_float32_reference(kernel, dtype, Hq, Hkv, D, T):
    # only full-precision tokens: more than the kernel reads ahead (its prefetch stops at the last
    # row) and not a whole number of its blocks; 3 to 15 queries per KV head (value sums are kept
    # for up to 4 of them at a time); with T > 1, keys after a query's position are masked for it
    q, q_pos, full, _, rope = make_inputs(Hq, Hkv, D, 0, 32, 8, 83, T, dtype=dtype)
    ref = attend_reference(q.float(), q_pos, as_float(full), None, rope, want_mass=True)
    got = cpu.attend(q, q_pos, full, None, rope, want_mass=True)
    assert got.out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.out.float(), ref.out, atol=tol, rtol=tol)
    torch.testing.assert_close(got.full_mass, ref.full_mass, atol=tol, rtol=tol)


def test_a_long_prefill_chunk_goes_to_the_reference(kernel, monkeypatch):
    q, q_pos, full, groups, rope = make_inputs(4, 2, 32, 2, 32, 8, cpu.MAX_QUERIES + 4, cpu.MAX_QUERIES + 1)
    assert not cpu.serves(q, full, groups)
    monkeypatch.setattr(cpu, "library", lambda: pytest.fail("the C library was called for a prefill chunk"))
    ref = attend_reference(q, q_pos, full, groups, rope)
    torch.testing.assert_close(cpu.attend(q, q_pos, full, groups, rope).out, ref.out, atol=0, rtol=0)


@pytest.mark.parametrize("k_bits, v_bits", [(8, 4), (16, 4), (4, 16)])
def test_keys_and_values_at_different_precisions_go_to_the_reference(kernel, monkeypatch, k_bits, v_bits):
    """The C kernel reads one precision for both sides: a split policy's groups (k8v4, kf16v4) never reach it."""
    q, q_pos, full, groups, rope = make_inputs(4, 2, 32, 2, 32, 8, 5, 1)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 32, 32, generator=gen), torch.randn(2, 2, 32, 32, generator=gen)
    side = lambda x, bits, fn: quant.FullGroups(x) if bits == 16 else fn(x, bits)
    split = QuantGroups(side(k, k_bits, quant.quantize_keys), side(v, v_bits, lambda x, b: quant.quantize_values(x, b, 32)),
                        groups.positions, 32)
    assert split.uniform_bits is None and groups.uniform_bits == 8 and cpu.serves(q, full, groups)
    assert not cpu.serves(q, full, split)
    monkeypatch.setattr(cpu, "library", lambda: pytest.fail("the C library was called for a split policy"))
    ref = attend_reference(q, q_pos, full, split, rope)
    torch.testing.assert_close(cpu.attend(q, q_pos, full, split, rope).out, ref.out, atol=0, rtol=0)


def test_switched_off_or_unbuildable_kernels_fall_back_to_the_reference(fresh_build_state, monkeypatch):
    q, q_pos, full, groups, rope = make_inputs(4, 2, 32, 2, 32, 8, 5, 1)
    ref = attend_reference(q, q_pos, full, groups, rope)
    monkeypatch.setenv(build.ENV, "off")
    assert cpu.library().reason == "LOCALCTX_CPU_KERNELS=off" and not cpu.available()
    torch.testing.assert_close(cpu.attend(q, q_pos, full, groups, rope).out, ref.out, atol=0, rtol=0)
    monkeypatch.setenv(build.ENV, "auto")
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    build.load.cache_clear()
    loaded = cpu.library()
    assert not loaded.ok and "did not build" in loaded.reason
    torch.testing.assert_close(cpu.attend(q, q_pos, full, groups, rope).out, ref.out, atol=0, rtol=0)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    build.load.cache_clear()
    assert cpu.library().reason == "no C compiler found (no-such-compiler-here)"
    monkeypatch.setenv(build.ENV, "sometimes")
    build.load.cache_clear()
    with pytest.raises(UserError, match="LOCALCTX_CPU_KERNELS='sometimes': choose auto"):
        cpu.library()


def test_an_unwritable_cache_is_a_reason_not_a_crash(fresh_build_state, tmp_path, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(blocker))
    loaded = cpu.library()
    assert not loaded.ok and "did not build" in loaded.reason


def test_the_library_is_built_once_into_the_user_cache(kernel, fresh_build_state, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    assert cpu.library().ok
    built = list((tmp_path / "kernels").glob("policy_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    build.load.cache_clear()
    assert cpu.library().ok  # a new process loads what is there
    assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("*.so")] == [stamp]
    assert not list((tmp_path / "kernels").glob("tmp*"))  # no half-written files left behind


def test_the_build_is_keyed_on_cpu_features_and_compiler_not_the_host_name(fresh_build_state, monkeypatch):
    source = Path(build.__file__).with_name("policy_attention.c")
    compiler, flags = build._compiler() or "cc", build.FLAG_SETS[0]
    here = build._target(source, compiler, flags)
    assert build.cpu_features() == " ".join(sorted(build.cpu_flags()))
    monkeypatch.setattr(build.platform, "node", lambda: "another-host")  # a renamed machine: same build
    assert build._target(source, compiler, flags) == here
    with monkeypatch.context() as m:  # the same home folder on a CPU with other features
        m.setattr(build, "cpu_features", lambda: "avx avx2 fma sse4_2")
        assert build._target(source, compiler, flags) != here
    with monkeypatch.context() as m:  # another compiler, or what -march=native means to it here
        m.setattr(build, "compiler_identity", lambda c, f: "gcc version 99.1.0\n-march=futurelake -mamx-tile")
        assert build._target(source, compiler, flags) != here


def test_compiler_identity_ignores_the_assemblers_temporary_file(monkeypatch):
    """GCC names its temporary assembly /tmp/cc??????.s: one that starts with "cc1" is not cc1's line
    (it made the identity, and the kernels' cache key, change once in ~60 runs)."""
    dry_run = ('gcc version 12.2.0 (Debian 12.2.0-14)\n'
               ' /usr/lib/gcc/x86_64-linux-gnu/12/cc1 -quiet /dev/null "-march=znver3" -mavx2 -o /tmp/cc1xYz9Q.s\n'
               ' as --64 -o /dev/null /tmp/cc1xYz9Q.s\n')
    monkeypatch.setattr(build.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout="", stderr=dry_run))
    build.compiler_identity.cache_clear()
    try:
        identity = build.compiler_identity("/usr/bin/gcc", ("-march=native",))
    finally:
        build.compiler_identity.cache_clear()
    assert identity.splitlines()[1:] == ["gcc version 12.2.0 (Debian 12.2.0-14)",
                                         '-quiet "-march=znver3" -mavx2 -o']


def test_compiler_identity_says_what_native_means_here_and_is_stable():
    compiler = build._compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    build.compiler_identity.cache_clear()
    first = build.compiler_identity(compiler, build.FLAG_SETS[0])
    build.compiler_identity.cache_clear()
    assert build.compiler_identity(compiler, build.FLAG_SETS[0]) == first  # no temporary file names
    assert " version " in first and "/tmp" not in first.split("\n", 1)[1]
    if platform.machine() == "x86_64" and "gcc" in first:
        assert ("-mavx2" in first) == ("avx2" in build.cpu_flags())


def test_a_build_for_other_cpu_features_is_never_loaded(kernel, fresh_build_state, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    assert cpu.library().ok
    (mine,) = (tmp_path / "kernels").glob("policy_attention-*.so")
    real = build.cpu_features
    monkeypatch.setattr(build, "cpu_features", lambda: real() + " pretend_feature")
    build.load.cache_clear()
    loaded = cpu.library()
    built = set((tmp_path / "kernels").glob("policy_attention-*.so"))
    assert loaded.ok and len(built) == 2 and mine in built
    assert Path(loaded.library._name) in built - {mine}  # its own build, not the other CPU's


@pytest.mark.skipif(os.name != "posix", reason="POSIX owners and modes")
def test_a_library_others_could_write_or_another_user_owns_is_never_loaded(kernel, fresh_build_state, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    old_umask = os.umask(0)  # whatever the umask, the folder is 0700 and the library 0600
    try:
        assert cpu.library().ok
    finally:
        os.umask(old_umask)
    (built,) = (tmp_path / "kernels").glob("policy_attention-*.so")
    assert stat.S_IMODE(built.stat().st_mode) == 0o600 and stat.S_IMODE(built.parent.stat().st_mode) == 0o700
    os.chmod(built, 0o666)  # anyone could have swapped code into it: built afresh over it, then loaded
    inode = built.stat().st_ino
    build.load.cache_clear()
    assert cpu.library().ok
    assert built.stat().st_ino != inode and stat.S_IMODE(built.stat().st_mode) == 0o600
    real = os.getuid()
    monkeypatch.setattr(private_files.os, "getuid", lambda: real + 1)  # every file here is "another user's"
    build.load.cache_clear()
    loaded = cpu.library()
    assert not loaded.ok and "not safe to load" in loaded.reason and "another user" in loaded.reason


@pytest.fixture(scope="module")
def tiny_gguf_head32(tmp_path_factory):
    cfg = TinyConfig(hidden=64, n_heads=2, n_kv_heads=1, head_dim=32)
    return write_gguf(tmp_path_factory.mktemp("tiny32") / "tiny.gguf", cfg, tiny_weights(cfg, seed=5))


@pytest.mark.parametrize("policy", ["int8+res32", "int4+res32", "fp16+sink4+win40", "int8+res32+sink4+win64+heavy32"])
def test_a_cpu_torch_session_decodes_through_the_kernel_as_the_reference_does(kernel, fresh_build_state, tiny_gguf_head32,
                                                                              monkeypatch, policy):
    options = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
    ref_model = ModelRef("gguf", tiny_gguf_head32, "tiny", "file")
    plan = Plan.fixed("torch", load_model(ref_model, options).spec, KVPolicy.parse(policy), 400)
    prompt = list(range(3, 140))

    def greedy(session) -> list[int]:
        engine = session.engine
        engine.cache.add_sequence(0)
        with torch.inference_mode():
            token = int(engine.prefill(0, prompt).argmax(-1))
            out = [token]
            for _ in range(60):  # well past the window and the residual: groups age, tokens leave
                token = int(engine.decode([0], [token])[0].argmax(-1))
                out.append(token)
        return out

    with_kernel = build_session(load_model(ref_model, options), plan, options)
    assert with_kernel.engine.cache.attention is cpu.attend
    monkeypatch.setenv(build.ENV, "off")
    build.load.cache_clear()
    reference = build_session(load_model(ref_model, options), plan, options)
    assert reference.engine.cache.attention is attend_reference
    assert greedy(with_kernel) == greedy(reference)


def test_the_speed_key_says_when_kv_attention_runs_in_torch(monkeypatch):
    options = TorchOptions(device="cpu", dtype=torch.bfloat16, weights="int8", threads=2)
    monkeypatch.setattr(cpu, "available", lambda: True)
    assert options.speed_key() == "cpu-bfloat16-int8-2t" and options.speed_settings()["kv_kernel"] == "c"
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert options.speed_key() == "cpu-bfloat16-int8-2t-torchkv"
