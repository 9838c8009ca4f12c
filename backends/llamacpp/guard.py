"""Whether the installed llama.cpp build can run on this machine, asked once and remembered.

A llama-cpp-python wheel compiled for another CPU (one cached by pip, or a shared environment), or
one whose AMX kernels run on threads the kernel never gave tile permission (llama.cpp built with
``-march=native`` on an AMX host), dies with SIGILL at the first matrix multiply. So before
localctx loads llama.cpp in its own process, a child process loads a small model and decodes on
several threads (backends/llamacpp/probe.py). Its verdict is kept in the user cache, keyed on
this CPU's feature flags and on the library files (path, size, modification time): a rebuild, an
upgrade or another CPU probes again; a verdict for another build or CPU is never reused.

A failed probe becomes a ``BuildProblem``: one line saying what is wrong and the command that
rebuilds llama-cpp-python for this CPU (backends/llamacpp/build_flags.py). ``registry.auto_name`` then
falls back to the torch backend with a notice; ``--backend llamacpp`` refuses with that line."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from localctx.backends.llamacpp.build_flags import cpu_flags, reinstall_command
from localctx.kvcache.hardware_profile import cache_dir
from localctx.kvcache.private_files import read_trusted, write_private

PROBE_VERSION = 1  # bump when the probe checks more: older verdicts are then ignored
PROBE_TIMEOUT_S = 300
_verdicts: dict[str, "BuildProblem | None"] = {}  # this process's verdicts, by probe key


@dataclass(frozen=True)
class BuildProblem:
    what: str  # e.g. "llama.cpp (…/llama_cpp/lib) died with SIGILL (illegal instruction) in a test decode: …"
    fix: str  # the command that rebuilds it for this CPU

    def line(self) -> str:
        return f"{self.what}; fix: {self.fix}"


def library_dir() -> Path | None:
    """llama-cpp-python's folder of shared libraries, found without importing it (None if absent)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def probe_key(lib: Path) -> str:
    """This CPU (feature flags as the OS reports them) × this build (every file of the library
    folder: name, size, modification time)."""
    try:
        files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in lib.iterdir() if p.is_file())
    except OSError:
        files = []
    cpu = sorted(cpu_flags()) or [platform.machine(), platform.processor()]
    text = json.dumps({"probe": PROBE_VERSION, "lib": str(lib.resolve()), "files": files, "cpu": cpu})
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def default_probe_command() -> list[str] | None:
    """The probe child: the bundled SmolLM2 GGUF decoded by llama.cpp (None without the model)."""
    from localctx.backends.models.ref import bundled_default_path
    from localctx.kvcache.errors import UserError

    try:
        model = bundled_default_path()
    except UserError:
        return None
    return [sys.executable, "-m", "localctx.backends.llamacpp.probe", str(model)]


def _fix() -> str:
    import importlib.metadata  # only on a failure: its import costs start-up time

    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = "0.3.36"
    return reinstall_command(version, python=sys.executable)


def run_probe(command: list[str], lib: Path) -> tuple[BuildProblem | None, bool]:
    """Run the probe child; returns (the problem or None, whether the verdict may be cached)."""
    from localctx.backends.llamacpp.probe import OK_LINE

    where = f"llama.cpp ({lib})"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return BuildProblem(f"{where} did not finish a test decode in {PROBE_TIMEOUT_S} s", _fix()), False
    except OSError as exc:
        return BuildProblem(f"{where} could not be tested: {exc}", _fix()), False
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode)
        why = " (illegal instruction)" if sig == signal.SIGILL else ""
        return BuildProblem(f"{where} died with {sig.name}{why} in a test decode: the build uses instructions "
                            "this CPU or OS does not allow (AMX tiles, or a build made on another CPU)",
                            _fix()), True
    if done.returncode != 0 or OK_LINE not in done.stdout:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1].strip()
        return BuildProblem(f"{where} failed a test decode: {last[:300]}", _fix()), True
    return None, True


def _cache_file(key: str) -> Path:
    return cache_dir() / "llamacpp-probe" / f"{key}.json"


def _read_cached(key: str) -> tuple[bool, BuildProblem | None]:
    raw = read_trusted(_cache_file(key))  # a result another user could have written is probed again
    if raw is None:
        return False, None
    try:
        data = json.loads(raw)
        problem = None if data["ok"] else BuildProblem(data["what"], data["fix"])
        return True, problem
    except (OSError, ValueError, KeyError, TypeError):
        return False, None


def _write_cached(key: str, problem: BuildProblem | None) -> None:
    path = _cache_file(key)
    data = {"ok": problem is None, "what": problem.what if problem else "", "fix": problem.fix if problem else ""}
    try:
        write_private(path, json.dumps(data))
    except OSError:
        pass  # an unwritable cache: the probe runs again next time, nothing worse


def check(probe_command: list[str] | None = None) -> BuildProblem | None:
    """None when the installed llama.cpp ran the probe here (or is not installed: nothing to
    guard), else what is wrong. Probes at most once per CPU and build (cached on disk)."""
    lib = library_dir()
    if lib is None:
        return None
    key = probe_key(lib)
    if key in _verdicts:
        return _verdicts[key]
    found, problem = _read_cached(key)
    if not found:
        command = probe_command or default_probe_command()
        if command is None:
            return None  # no model to probe with: nothing is known, nothing is claimed
        problem, cacheable = run_probe(command, lib)
        if cacheable:
            _write_cached(key, problem)
    _verdicts[key] = problem
    return problem
