"""Compile a kernel's C source once per machine and load it.

The shared library is built with the system's C compiler (``$CC``, else ``cc``) for this CPU
(``-O3 -march=native -fopenmp``) into the user cache, under a name that hashes the source, the
flags and the machine, so an edited kernel or another CPU builds afresh. The build is written
under a temporary name and renamed into place, so two processes never load a half-written file.

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

from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware import cache_dir

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


def _target(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    digest = hashlib.sha256()
    for part in (source.read_bytes(), compiler.encode(), " ".join(flags + COMMON).encode(),
                 platform.machine().encode(), platform.node().encode()):
        digest.update(part)
    return cache_dir() / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def _compile(source: Path, compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Build ``target``; returns None, or the compiler's (or the file system's) complaint."""
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        done = subprocess.run([compiler, *flags, *COMMON, str(source), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            return (done.stderr.strip().splitlines() or ["failed"])[-1]
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
        if not target.exists():
            complaint = _compile(source, compiler, flags, target)
            if complaint is not None:
                continue
        try:
            return Loaded(ctypes.CDLL(str(target)), f"{Path(compiler).name} {' '.join(flags)}")
        except OSError as exc:
            complaint = str(exc)
    return Loaded(None, f"{source_name} did not build: {complaint}")
