"""Compile a kernel's C source once per machine and load it.

The shared library is built with the system's C compiler (``$CC``, else ``cc``) for this CPU
(``-O3 -march=native -fopenmp``) into the user cache, under a name that hashes the source, the
flags, the compiler (its path, version, and what ``-march=native`` means to it here, from its
``-###`` dry run) and the CPU's feature flags (/proc/cpuinfo). An edited kernel, another compiler or
a CPU with other features — a home folder shared between machines — builds afresh: a library
built for other instructions is never loaded. The build is written
under a temporary name and renamed into place, so two processes never load a half-written file.
The kernels folder is 0700 and a library 0600; a library another user owns, or one that group or
others could write (or its folder), is never loaded: it is built afresh over it, and where that
cannot be done the kernel is not used (kvcache/private_files.py).

``LOCALCTX_CPU_KERNELS=off`` keeps every call on the pure-torch references (to compare, or when a
kernel is suspected). Where no compiler works, ``load`` says why and the caller falls back."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from localctx.backends.llamacpp.build_flags import cpu_flags
from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import cache_dir
from localctx.kvcache.private_files import FILE_MODE, private_dir, untrusted

ENV = "LOCALCTX_CPU_KERNELS"
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-fopenmp"))  # the second where -march=native is refused
# fused multiply-adds and reassociated float sums (vectorised dot products), but IEEE infinities
# kept: masked scores are -inf
COMMON = ("-shared", "-fPIC", "-std=c11", "-ffp-contract=fast", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math")


@dataclass(frozen=True)
class Loaded:
    library: ctypes.CDLL | None
    reason: str  # how it was built, or why there is no library

    @property
    def ok(self) -> bool:
        return self.library is not None


def enabled() -> bool:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise UserError(f"{ENV}={value!r}: choose auto (build and use the C kernels) or off (the torch references)")
    return value == "auto"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def cpu_features() -> str:
    """This CPU's feature flags as the OS reports them (Linux); '' where it does not."""
    return " ".join(sorted(cpu_flags()))


@functools.cache
def compiler_identity(compiler: str, flags: tuple[str, ...]) -> str:
    """The compiler's version and the code-generation options ``flags`` expand to on this CPU:
    the version line(s) and the compiler proper's command line from a ``-###`` dry run (nothing
    is compiled), without file paths (temporary names differ per run). For GCC this names every
    ``-m`` extension ``-march=native`` turns on or off; for clang the target CPU and features."""
    try:
        done = subprocess.run([compiler, *flags, "-###", "-x", "c", "-c", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=60)
        lines = (done.stdout + done.stderr).splitlines()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{os.path.realpath(compiler)}: no dry run ({type(exc).__name__})"
    kept = [line.strip() for line in lines if " version " in line]
    kept += [" ".join(t for t in line.split() if "/" not in t) for line in lines if _runs_compiler_proper(line)]
    return "\n".join([os.path.realpath(compiler), *kept])


def _runs_compiler_proper(line: str) -> bool:
    """A dry run's line that runs GCC's cc1 or clang's -cc1 (not the assembler: its temporary
    file, /tmp/cc??????.s, may itself start with "cc1")."""
    tokens = [token.strip('"') for token in line.split()]
    return bool(tokens) and (os.path.basename(tokens[0]) == "cc1" or "-cc1" in tokens)


def _target(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    """Where the build of ``source`` for this compiler, these flags and this CPU lives."""
    digest = hashlib.sha256()
    for part in (source.read_bytes(), compiler_identity(compiler, flags), " ".join(flags + COMMON),
                 platform.machine(), cpu_features()):
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return cache_dir() / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def _compile(source: Path, compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Build ``target``; returns None, or the compiler's (or the file system's) complaint."""
    tmp = None
    try:
        private_dir(target.parent)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        done = subprocess.run([compiler, *flags, *COMMON, str(source), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            return (done.stderr.strip().splitlines() or ["failed"])[-1]
        os.chmod(tmp, FILE_MODE)  # the linker may have written it anew with the umask's mode
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load(source_name: str) -> Loaded:
    """The kernel library built from ``source_name`` (a .c file beside this module)."""
    if not enabled():
        return Loaded(None, f"{ENV}=off")
    source = Path(__file__).with_name(source_name)
    compiler = _compiler()
    if compiler is None:
        return Loaded(None, f"no C compiler found ({os.environ.get('CC') or 'cc'})")
    complaint = "not tried"
    for flags in FLAG_SETS:
        target = _target(source, compiler, flags)
        if not target.exists() or untrusted(target):  # a library someone else could have written: build anew
            complaint = _compile(source, compiler, flags, target)
            if complaint is not None:
                continue
        why = untrusted(target)
        if why:
            complaint = f"{target} is not safe to load: {why}"
            continue
        try:
            return Loaded(ctypes.CDLL(str(target)), f"{Path(compiler).name} {' '.join(flags)}")
        except OSError as exc:
            complaint = str(exc)
    return Loaded(None, f"{source_name} did not build: {complaint}")
