"""The plugin seam: backend name → class, imported only when asked for."""
from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
from pathlib import Path

from localctx.backends.base import Backend
from localctx.kvcache.errors import UserError

_BACKENDS = {
    "llamacpp": "localctx.backends.llamacpp:LlamaCppBackend",
    "torch": "localctx.backends.torch.backend:TorchBackend",
    "mlx": "localctx.backends.mlx.backend:MLXBackend",
    "fake": "localctx.backends.fake:FakeBackend",
    "openai": "localctx.backends.openai.remote:RemoteBackend",
}
USER_FACING = ("llamacpp", "torch", "mlx")


def names() -> list[str]:
    return list(_BACKENDS)


def get(name: str) -> Backend:
    target = _BACKENDS.get(name)
    if target is None:
        raise UserError(f"unknown backend {name!r}; choose one of {', '.join(USER_FACING)} (or auto, or openai with --endpoint)")
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
    """Apple Silicon → mlx; an NVIDIA GPU → torch; otherwise llama.cpp (docs/architecture.md "Backends")."""
    if sys.platform == "darwin" and platform.machine() == "arm64" and importlib.util.find_spec("mlx"):
        return "mlx"
    if Path("/proc/driver/nvidia/version").exists() and importlib.util.find_spec("torch"):
        return "torch"
    return "llamacpp"


def backend_class(name: str) -> type[Backend] | None:
    """The class behind ``name`` without checking that it can run here (planning on paper for
    another machine); None when this build lacks the backend or the packages it imports."""
    target = _BACKENDS.get(name)
    if target is None:
        raise UserError(f"unknown backend {name!r}; choose one of {', '.join(USER_FACING)} (or auto)")
    module_name, _, cls_name = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except ImportError:
        return None
