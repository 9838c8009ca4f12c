"""The prompt cache on disk: the KV of long prompts, kept in the user cache directory so that a
later prompt that starts with the same tokens loads it and prefills only the rest.

Where: ``<cache dir>/prompts/<scope>/<prefix hash>.safetensors`` (``kvcache/prompt_cache_file.py``).
A scope is one (model content hash, backend, KV policy, cache layout); a file holds the cache
of one token prefix, in the cache's own format (quantized groups stay quantized, a window keeps
its positions), with that token list, and its metadata lists a hash of every CHUNK-token prefix
of those tokens: an index, so that a lookup reads only the headers to find the files worth
opening.

Two ways to save and reuse, by what the cache can do:
- a cache that can be cut back at any token (llama.cpp's cells, the torch engine's paged fp16/fp32
  cache) saves the whole prompt but its last token (``exact_save_point``: that one is evaluated
  again, for the logits) and reuses a file up to the first token where it and the prompt differ;
- a cache that cannot (quantized groups with a full-precision tail, MLX's caches) saves at the
  last CHUNK boundary (``save_point``: a continued prompt is then prefilled in exactly the
  chunks a cold run uses) and uses a file only whole (``lookup(whole_only=True)``).
A file is used only if its metadata names this scope and its length and checksum hold; otherwise
it is removed with a one-line notice. Disk use is bounded: after each write the least recently
used files (mtime, touched on every hit) go until the total fits."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from localctx.kvcache import prompt_cache_file
from localctx.kvcache.hardware_profile import cache_dir
from localctx.kvcache.private_files import read_trusted, write_private
from localctx.kvcache.prompt_cache_file import BadPromptFile, PromptFile

CHUNK = 512  # = the prefill chunk of the torch engine and llama.cpp's n_batch
MIN_TOKENS = 512  # shorter prompts are not worth a file
BUDGET_ENV = "LOCALCTX_PROMPT_CACHE_BYTES"
DEFAULT_BUDGET = 4 << 30
SUFFIX = ".safetensors"


def root() -> Path:
    return cache_dir() / "prompts"


def budget_bytes() -> int:
    raw = os.environ.get(BUDGET_ENV)
    try:
        return int(raw) if raw else DEFAULT_BUDGET
    except ValueError:
        return DEFAULT_BUDGET


def stderr_notice(line: str) -> None:
    print(f"localctx: {line}", file=sys.stderr)


# -- the model's content hash, computed once per (path, size, mtime) -----------------------------------
def model_hash(path: Path) -> str:
    """SHA-256 of the model file's bytes; remembered in the cache directory against the file's
    path, size and mtime, so it is read once (a file swapped in place gets a new hash)."""
    path = Path(path).resolve()
    st = path.stat()
    memo_path = root() / "model-hashes.json"
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(read_trusted(memo_path) or b"{}")
    except ValueError:
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(key), str):
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    value = digest.hexdigest()
    memo = {k: v for k, v in (memo if isinstance(memo, dict) else {}).items() if not k.startswith(f"{path}|")}
    memo[key] = value
    write_private(memo_path, json.dumps(memo))
    return value


# -- keys ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheScope:
    model_hash: str
    backend: str
    policy: str
    layout: str  # what else the bytes depend on: dtype, KV types, shapes

    def key(self) -> str:
        return hashlib.sha256("|".join(asdict(self).values()).encode()).hexdigest()[:20]

    def metadata(self) -> dict[str, str]:
        return {f"scope_{k}": v for k, v in asdict(self).items()}


def chunk_hashes(tokens: Sequence[int], n_chunks: int | None = None) -> list[str]:
    """Hash of every CHUNK-token prefix (one running digest, so the cost is one pass)."""
    arr = np.asarray(tokens, dtype=np.int32)
    total = len(arr) // CHUNK if n_chunks is None else min(n_chunks, len(arr) // CHUNK)
    digest = hashlib.sha256()
    out = []
    for i in range(total):
        digest.update(arr[i * CHUNK:(i + 1) * CHUNK].tobytes())
        out.append(digest.copy().hexdigest()[:16])
    return out


def save_point(n_prompt: int, reused: int) -> int:
    """Where to save a prompt's cache: the last CHUNK boundary before its final token, when the
    prefill since ``reused`` runs in whole chunks from 0 (else 0: nothing to save)."""
    at = (n_prompt - 1) // CHUNK * CHUNK
    return at if at >= MIN_TOKENS and at > reused and reused % CHUNK == 0 else 0


def exact_save_point(n_prompt: int, reused: int, replay: int = 1) -> int:
    """Where a cache that can be cut at any token saves a prompt: all but its final ``replay`` tokens
    (evaluated again, for the logits), when that adds at least CHUNK tokens to what was reused (a second
    question about a loaded document writes no second copy of it); else 0."""
    at = n_prompt - replay
    return at if at >= MIN_TOKENS and at - reused >= CHUNK else 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class Hit:
    file: PromptFile
    n_tokens: int  # tokens of the file this prompt can use (its common prefix with the file)


class PromptCache:
    """``scope`` is made on first use (it hashes the model file, once per file version), so a
    session that never sees a long prompt never reads the model file again."""

    def __init__(self, scope: Callable[[], CacheScope], notice: Callable[[str], None] = stderr_notice):
        self._make_scope = scope
        self._scope: CacheScope | None = None
        self.notice = notice

    @property
    def scope(self) -> CacheScope:
        if self._scope is None:
            self._scope = self._make_scope()
        return self._scope

    @property
    def folder(self) -> Path:
        return root() / self.scope.key()

    def _reject(self, path: Path, why: str) -> None:
        try:
            path.unlink(missing_ok=True)
            done = "removed it"
        except OSError as exc:
            done = f"could not remove it ({exc.strerror or exc})"
        self.notice(f"prompt cache: ignoring {path.name}: {why}; {done}")

    def _candidates(self, hashes: list[str]) -> list[tuple[int, Path]]:
        """(leading CHUNK hashes shared with the prompt, path) of the files that share at least
        one, most first, from the headers alone: a file sharing m chunk hashes shares at least
        m * CHUNK tokens and fewer than (m + 1) * CHUNK (or all of itself)."""
        out = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                header, _ = prompt_cache_file.read_header(path)
            except BadPromptFile as exc:
                self._reject(path, str(exc))
                continue
            meta = header["__metadata__"]
            if any(meta.get(k) != v for k, v in self.scope.metadata().items()):
                self._reject(path, "it was made for another model, backend, KV policy or layout")
                continue
            try:
                stored = json.loads(meta.get("chunk_hashes", "[]"))
            except ValueError:
                self._reject(path, "its prefix list is unreadable")
                continue
            m = 0
            while m < min(len(stored), len(hashes)) and stored[m] == hashes[m]:
                m += 1
            if m:
                out.append((m, path))
        return sorted(out, key=lambda c: -c[0])

    def lookup(self, tokens: Sequence[int], limit: int, whole_only: bool = False) -> Hit | None:
        """The file sharing the longest token prefix with ``tokens`` (used up to ``limit`` tokens).
        ``whole_only``: the cache cannot be cut back, so a file counts only if all of it is used."""
        if limit < MIN_TOKENS or not self.folder.is_dir():
            return None
        want = np.asarray(tokens[:limit], dtype=np.int32)
        ranked = []
        for m, path in self._candidates(chunk_hashes(want)):
            if ranked and (m + 1) * CHUNK <= -min(ranked)[0]:
                break  # this file and the rest share fewer tokens than one already found
            try:  # the token list only: the checksum is checked on the file chosen
                stored = prompt_cache_file.read(path, verify=False).tensors["tokens"]
            except (BadPromptFile, KeyError) as exc:
                self._reject(path, str(exc) if isinstance(exc, BadPromptFile) else "it holds no token list")
                continue
            n = common_prefix(stored, want)
            if whole_only and n != len(stored):
                continue
            if n >= MIN_TOKENS:
                ranked.append((-n, len(stored), path))
        for minus_n, _, path in sorted(ranked):
            try:
                f = prompt_cache_file.read(path)
            except BadPromptFile as exc:
                self._reject(path, str(exc))
                continue
            os.utime(path)  # least-recently-used order
            return Hit(f, -minus_n)
        return None

    def save(self, tokens: Sequence[int], tensors: dict[str, np.ndarray], extra: dict[str, str]) -> Path | None:
        """Write the cache of ``tokens`` unless a file already holds it."""
        hashes = chunk_hashes(tokens)
        name = hashlib.sha256(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:16]
        path = self.folder / f"{name}{SUFFIX}"
        if path.exists():
            os.utime(path)
            return None
        meta = dict(self.scope.metadata(), **extra, n_tokens=str(len(tokens)), chunk_hashes=json.dumps(hashes),
                    created=str(int(time.time())))
        prompt_cache_file.write(path, dict(tensors, tokens=np.asarray(tokens, dtype=np.int32)), meta)
        evict_to_budget(budget_bytes(), keep=path)
        return path


# -- the whole cache (localctx cache ls|rm|clear) -------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    path: Path
    size: int
    used: float  # mtime: last write or hit
    meta: dict

    @property
    def name(self) -> str:
        return f"{self.path.parent.name[:8]}/{self.path.stem}"


def entries() -> list[Entry]:
    """Every file under the cache root, most recently used first (unreadable headers: meta = {})."""
    out = []
    base = root()
    if not base.is_dir():
        return out
    for path in base.glob(f"*/*{SUFFIX}"):
        try:
            st = path.stat()
        except OSError:
            continue
        try:
            meta = prompt_cache_file.read_header(path)[0]["__metadata__"]
        except BadPromptFile:
            meta = {}
        out.append(Entry(path, st.st_size, st.st_mtime, meta))
    return sorted(out, key=lambda e: -e.used)


def evict_to_budget(budget: int, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used files until the total is within ``budget``."""
    all_entries = entries()
    total = sum(e.size for e in all_entries)
    removed = []
    for e in reversed(all_entries):
        if total <= budget:
            break
        if e.path == keep:
            continue
        e.path.unlink(missing_ok=True)
        total -= e.size
        removed.append(e.path)
    return removed
