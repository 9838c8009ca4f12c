"""GGUF headers parsed once per file: kept in memory for the process and as JSON in the user
cache dir, keyed by the file's path, size and modification time (a changed file is parsed again).

The header is what is cached, not the ModelSpec built from it: every spec reader (llama.cpp,
torch, the planner) gets the same metadata, and the spec's own shape can change without a
stale cache. A damaged cache file is ignored and rewritten, and so is one another user could
have written (kvcache/private_files.py); writes are atomic (temp + rename) and owner-only."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from localctx.backends.models import gguf_header
from localctx.backends.models.gguf_header import GGUFHeader
from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import cache_dir
from localctx.kvcache.private_files import read_trusted, write_private

CACHE_FORMAT = 1
_memo: dict[tuple[str, int, int], GGUFHeader] = {}


def file_key(path: Path) -> tuple[str, int, int]:
    """(absolute path, size, mtime in ns): what a cached header must match."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UserError(f"cannot read model file {path}: {exc.strerror or exc}; check that it exists") from None
    return str(Path(path).resolve()), st.st_size, st.st_mtime_ns


def cache_path(resolved: str) -> Path:
    return cache_dir() / "gguf-headers" / f"{hashlib.sha256(resolved.encode()).hexdigest()[:24]}.json"


def cached_header(path: Path | str) -> GGUFHeader:
    """``path``'s header: from this process's memo, else the cache file, else parsed (and stored)."""
    path = Path(path)
    key = file_key(path)
    header = _memo.get(key)
    if header is None:
        header = _load(path, key)
        if header is None:
            header = gguf_header.read_header(path)
            _store(key, header)
        _memo[key] = header
    return header


def _load(path: Path, key: tuple[str, int, int]) -> GGUFHeader | None:
    raw = read_trusted(cache_path(key[0]))
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        if data.get("format") != CACHE_FORMAT or [data.get("path"), data.get("size"), data.get("mtime_ns")] != list(key):
            return None
        return GGUFHeader.from_json(path, data["header"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # absent or damaged: parse again
        return None


def _store(key: tuple[str, int, int], header: GGUFHeader) -> None:
    data = {"format": CACHE_FORMAT, "path": key[0], "size": key[1], "mtime_ns": key[2], "header": header.to_json()}
    with contextlib.suppress(OSError, ValueError):  # a read-only or full cache dir only costs the next run a parse
        write_private(cache_path(key[0]), json.dumps(data))


def forget() -> None:
    """Drop this process's memo (tests, or a long-lived process that rewrites files in place)."""
    _memo.clear()
