"""The CMake flags localctx builds llama-cpp-python with, and the CPU identity they depend on.

Run as a script before installing: `CMAKE_ARGS="$(python3 backends/llamacpp/build_flags.py)" pip install
--no-cache-dir .` (the README's install command). Standard library only, so it runs before anything
is installed.

Why not llama.cpp's default (`GGML_NATIVE=ON`, i.e. `-march=native`): on a CPU with AMX,
`-march=native` compiles ggml's AMX matrix kernels in, and llama.cpp asks the kernel for AMX tile
permission on its main thread only; its worker threads then die with SIGILL on the first tile
instruction. So on x86-64 the flags name every SIMD extension this CPU has that ggml uses (SSE4.2,
AVX, AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512 F/VBMI/VNNI/BF16) explicitly, and never AMX: the same
ggml code paths as a native build, minus the AMX ones. The build is still specific to this CPU's
features, so pip must not reuse a wheel it cached from another machine: pip's wheel cache is keyed
on the source archive only (not on CMAKE_ARGS, not on the CPU), hence `--no-cache-dir`. A build
that does not fit this CPU anyway is caught at run time by backends/llamacpp/guard.py.
On other architectures (ARM, Apple Silicon) there is no AMX; the flags are empty and llama.cpp's
native default stays.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

# ggml CMake option -> the /proc/cpuinfo flags it needs (all of them)
GGML_X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    # ggml's GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
# never compiled in: llama.cpp's worker threads run tile instructions without the kernel's permission
GGML_DISABLED_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# llama-cpp-python's multimodal library (llama.cpp's mtmd: clip and ~50 vision/audio encoders), which
# localctx never loads; leaving it out takes a quarter off the build's CPU time (12m56s -> 9m49s here)
SKIPPED_LIBRARIES = ("LLAVA_BUILD",)


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU feature flags the OS reports (Linux: the first `flags` line of /proc/cpuinfo).

    Linux lists only what it has enabled (e.g. no avx512f when the kernel does not save its state).
    Empty where there is no /proc/cpuinfo (macOS, Windows)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cmake_args(flags: frozenset[str] | None = None, x86_64: bool | None = None) -> str:
    """The CMAKE_ARGS for llama-cpp-python on a CPU with `flags` (this one by default)."""
    flags = cpu_flags() if flags is None else flags
    x86_64 = is_x86_64() if x86_64 is None else x86_64
    if not x86_64 or not flags:
        return ""
    options = ["-DGGML_NATIVE=OFF"]
    for option, needs in GGML_X86_OPTIONS:
        options.append(f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}")
    options.extend(f"-D{option}=OFF" for option in GGML_DISABLED_OPTIONS + SKIPPED_LIBRARIES)
    return " ".join(options)


def reinstall_command(version: str, python: str = "python") -> str:
    """The command that rebuilds llama-cpp-python `version` for this CPU (pip's cached wheel,
    built for whichever CPU, is not reused)."""
    args = cmake_args()
    prefix = f'CMAKE_ARGS="{args}" ' if args else ""
    return (f"{prefix}{python} -m pip install --force-reinstall --no-cache-dir --no-deps "
            f"llama-cpp-python=={version}")


if __name__ == "__main__":
    sys.stdout.write(cmake_args() + "\n")
