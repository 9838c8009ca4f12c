"""The plugin seam: backend name → class, imported only when asked for.

The user-facing backends are built in. Others are registered by whoever needs them: in process
with ``register(name, "module:Class")``, or for a whole process tree with the environment variable
``LOCALCTX_BACKEND_PLUGINS="name=module:Class,..."``. The test suite reaches its fake backend
this way (tests/conftest.py), so ``--backend fake`` is not something the CLI offers."""
from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
from pathlib import Path

from localctx.backends.base import Backend
from localctx.kvcache.errors import RuntimeFailure, UserError

_BACKENDS = {
    "llamacpp": "localctx.backends.llamacpp.backend:LlamaCppBackend",
    "torch": "localctx.backends.torch.backend:TorchBackend",
    "mlx": "localctx.backends.mlx.backend:MLXBackend",
    "openai": "localctx.backends.openai.backend:RemoteBackend",
}
USER_FACING = tuple(_BACKENDS)
PLUGINS_ENV = "LOCALCTX_BACKEND_PLUGINS"
_registered: dict[str, str] = {}


def register(name: str, target: str) -> None:
    """Make backend ``name`` (``"module:Class"``) available in this process."""
    if name in _BACKENDS:
        raise ValueError(f"backend {name!r} is built in")
    _registered[name] = target


def _plugins() -> dict[str, str]:
    out = {}
    for entry in os.environ.get(PLUGINS_ENV, "").split(","):
        name, sep, target = entry.strip().partition("=")
        if sep and name and ":" in target and name not in _BACKENDS:
            out[name] = target
    return out


def _targets() -> dict[str, str]:
    return {**_BACKENDS, **_plugins(), **_registered}


def names() -> list[str]:
    return list(_targets())


def unknown_backend(name: str) -> UserError:
    return UserError(f"unknown backend {name!r}; choose one of {', '.join(USER_FACING)} "
                     "(or auto; openai takes --endpoint URL)")


def get(name: str) -> Backend:
    target = _targets().get(name)
    if target is None:
        raise unknown_backend(name)
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("localctx"):
            raise UserError(f"backend {name!r} is not part of this localctx build yet") from None
        raise UserError(f"backend {name!r} needs the package {exc.name!r}: pip install 'localctx[{name}]'") from None
    backend = getattr(module, cls_name)()
    reason = backend.unavailable_reason()
    if reason:
        raise UserError(f"backend {name!r} cannot run here: {reason}")
    return backend


def auto_name() -> str:
    """Apple Silicon → mlx; an NVIDIA GPU → torch; otherwise llama.cpp (docs/architecture.md "Backends"),
    unless its build cannot run here: then torch, with a notice (backends/llamacpp/guard.py)."""
    if sys.platform == "darwin" and platform.machine() == "arm64" and importlib.util.find_spec("mlx"):
        return "mlx"
    if Path("/proc/driver/nvidia/version").exists() and importlib.util.find_spec("torch"):
        return "torch"
    return _llamacpp_or_fallback()


_notified: set[str] = set()


def _llamacpp_or_fallback() -> str:
    from localctx.backends.llamacpp import guard

    problem = guard.check()
    if problem is None:
        return "llamacpp"
    if importlib.util.find_spec("torch") is None:
        raise RuntimeFailure(f"{problem.line()} (the torch backend, the fallback, is not installed)")
    if problem.what not in _notified:
        _notified.add(problem.what)
        print(f"localctx: {problem.line()}", file=sys.stderr)
        print("localctx: using the torch backend instead until llama.cpp is rebuilt", file=sys.stderr)
    return "torch"


def backend_class(name: str) -> type[Backend] | None:
    """The class behind ``name`` without checking that it can run here (planning on paper for
    another machine); None when this build lacks the backend or the packages it imports."""
    target = _targets().get(name)
    if target is None:
        raise unknown_backend(name)
    module_name, _, cls_name = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except ImportError:
        return None
