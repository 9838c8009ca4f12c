"""The llama.cpp build guard: a probe child that dies (SIGILL) or fails becomes one line naming
the problem and the fix, then the torch backend with a notice — never a signal in localctx's own
process. Verdicts are cached per CPU and per build, and never reused for another."""
from __future__ import annotations

import json
import sys

import pytest

from localctx.backends import registry
from localctx.backends.llamacpp import build_flags, guard
from localctx.backends.llamacpp.probe import OK_LINE
from localctx.kvcache.hardware_profile import cache_dir
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

SIGILL_CHILD = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
FAILING_CHILD = [sys.executable, "-c", "import sys; print('loading'); sys.exit('ggml: failed to allocate CPU buffer')"]


def passing_child(marker):
    """A probe that passes and leaves ``marker`` behind, to tell whether it ran."""
    return [sys.executable, "-c", f"open({str(marker)!r}, 'w').close(); print({OK_LINE!r})"]


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A llama_cpp/lib folder of our own (its files are the build's identity); no verdicts yet."""
    lib = tmp_path / "site" / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    (lib / "libllama.so").write_bytes(b"x" * 100)
    (lib / "libggml-cpu.so").write_bytes(b"y" * 200)
    monkeypatch.setattr(guard, "library_dir", lambda: lib)
    monkeypatch.setattr(guard, "_verdicts", {})
    monkeypatch.setattr(registry, "_notified", set())
    return lib


def cached_verdicts() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((cache_dir() / "llamacpp-probe").glob("*.json"))]


def test_a_probe_killed_by_sigill_is_one_line_naming_the_fix(fake_build):
    problem = guard.check(SIGILL_CHILD)
    assert problem is not None and "\n" not in problem.line()
    assert problem.what.startswith(f"llama.cpp ({fake_build}) died with SIGILL (illegal instruction)")
    assert problem.fix.endswith("-m pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python=="
                                + guard.importlib.metadata.version("llama-cpp-python"))
    if build_flags.is_x86_64() and build_flags.cpu_flags():  # rebuilt without AMX, for this CPU
        assert problem.fix.startswith(f'CMAKE_ARGS="{build_flags.cmake_args()}" ')
        assert "-DGGML_NATIVE=OFF" in problem.fix and "-DGGML_AMX_TILE=OFF" in problem.fix
    assert cached_verdicts() == [{"ok": False, "what": problem.what, "fix": problem.fix}]


def test_a_probe_that_exits_non_zero_names_its_last_error_line(fake_build):
    problem = guard.check(FAILING_CHILD)
    assert problem.what == f"llama.cpp ({fake_build}) failed a test decode: ggml: failed to allocate CPU buffer"


def test_a_verdict_is_reused_for_the_same_cpu_and_build_only(fake_build, tmp_path, monkeypatch):
    failed = guard.check(SIGILL_CHILD)
    marker = tmp_path / "probed"
    monkeypatch.setattr(guard, "_verdicts", {})  # a new process: the verdict comes from the cache
    assert guard.check(passing_child(marker)) == failed and not marker.exists()

    with monkeypatch.context() as m:  # the same cache on a CPU with other features: probed again
        m.setattr(guard, "cpu_flags", lambda: frozenset({"sse4_2", "avx", "avx2", "fma"}))
        m.setattr(guard, "_verdicts", {})
        assert guard.check(passing_child(marker)) is None and marker.exists()
    marker.unlink()

    (fake_build / "libggml-cpu.so").write_bytes(b"z" * 300)  # rebuilt (another size, another time)
    monkeypatch.setattr(guard, "_verdicts", {})
    assert guard.check(passing_child(marker)) is None and marker.exists()
    marker.unlink()
    monkeypatch.setattr(guard, "_verdicts", {})
    assert guard.check(SIGILL_CHILD) is None  # the good verdict for this build is kept
    assert sorted(v["ok"] for v in cached_verdicts()) == [False, True, True]
    assert not list((cache_dir() / "llamacpp-probe").glob("*.tmp*"))


def test_a_probe_that_cannot_finish_is_not_remembered(fake_build, monkeypatch):
    monkeypatch.setattr(guard, "PROBE_TIMEOUT_S", 1)
    problem = guard.check([sys.executable, "-c", "import time; time.sleep(30)"])
    assert "did not finish a test decode in 1 s" in problem.what and cached_verdicts() == []


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    cfg = TinyConfig()
    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", cfg, tiny_weights(cfg, seed=3))


def test_run_falls_back_to_torch_with_a_notice_instead_of_dying(fake_build, tiny_gguf, cli, monkeypatch):
    monkeypatch.setattr(guard, "default_probe_command", lambda: SIGILL_CHILD)
    if sys.platform == "darwin" or registry.Path("/proc/driver/nvidia/version").exists():
        pytest.skip("auto picks MLX or torch on this machine before llama.cpp is considered")
    monkeypatch.setenv("LOCALCTX_TORCH_DTYPE", "fp32")
    res = cli("run", "-m", str(tiny_gguf), "--context", "128", "--max-tokens", "4", "--json", "the hat")
    assert res.code == 0, res.err
    assert json.loads(res.out)["backend"] == "torch"
    lines = res.err.strip().splitlines()
    assert lines[0].startswith(f"localctx: llama.cpp ({fake_build}) died with SIGILL (illegal instruction)")
    assert "; fix: " in lines[0] and "pip install --force-reinstall --no-cache-dir" in lines[0]
    assert lines[1] == "localctx: using the torch backend instead until llama.cpp is rebuilt"

    res = cli("run", "-m", str(tiny_gguf), "--backend", "llamacpp", "hi")  # asked for by name: refused
    assert res.code == 2 and len(res.err.strip().splitlines()) == 1
    assert res.err.startswith("localctx: error: backend 'llamacpp' cannot run here: llama.cpp (")

    real_find_spec = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    res = cli("run", "-m", str(tiny_gguf), "hi")  # and no torch to fall back to: one line, exit 1
    assert res.code == 1 and len(res.err.strip().splitlines()) == 1
    assert res.err.startswith("localctx: failed: llama.cpp (") and "not installed" in res.err


@pytest.mark.slow
def test_the_installed_build_passes_the_real_probe_here(monkeypatch):
    """The real probe child (bundled SmolLM2, several threads, fp16 and q8_0 KV) on this machine."""
    monkeypatch.setattr(guard, "_verdicts", {})
    if guard.library_dir() is None:
        pytest.skip("llama-cpp-python is not installed")
    assert guard.check() is None
    assert cached_verdicts() == [{"ok": True, "what": "", "fix": ""}]


SAPPHIRE_RAPIDS = frozenset(("sse4_2 avx avx2 fma f16c bmi2 avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw "
                             "avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16").split())


def test_build_flags_keep_every_simd_extension_of_the_cpu_and_never_amx():
    args = build_flags.cmake_args(SAPPHIRE_RAPIDS, x86_64=True).split()
    assert args[0] == "-DGGML_NATIVE=OFF"
    on = {a[2:-3] for a in args if a.endswith("=ON")}
    assert on == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX_VNNI",
                  "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    assert "-DLLAVA_BUILD=OFF" in args  # the multimodal library localctx never loads is not built
    # ggml's AVX512 option compiles with F, CD, VL, DQ and BW: a CPU without BW does not get it
    assert "-DGGML_AVX512=OFF" in build_flags.cmake_args(SAPPHIRE_RAPIDS - {"avx512bw"}, x86_64=True)
    assert build_flags.cmake_args(frozenset({"fp", "asimd", "sve"}), x86_64=False) == ""  # ARM: llama.cpp's defaults


def test_cpu_flags_come_from_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert build_flags.cpu_flags(info) == {"fpu", "sse4_2", "avx2"}
    assert build_flags.cpu_flags(tmp_path / "missing") == frozenset()
