"""Owner-only files (kvcache/private_files.py): folders 0700 and files 0600 whatever the umask, and
a file another user owns, or that group or others could write, or that sits in such a folder, is
never used — the prompt cache, calibrations, GGUF headers, the llama.cpp probe result, the
bandwidth measurement and the chat history all go through it (the compiled CPU kernel:
tests/backends/torch/test_cpu_kernels.py). Another owner is simulated by moving os.getuid."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from localctx.app.history import DB_NAME, History
from localctx.backends.models import gguf_header_cache
from localctx.backends.models.ref import bundled_default_path
from localctx.kvcache import calibration, private_files, prompt_cache_file
from localctx.kvcache.calibration import Calibration, FormatCost
from localctx.kvcache.errors import RuntimeFailure
from localctx.kvcache.private_files import private_dir, untrusted, write_private
from localctx.kvcache.prompt_cache import CHUNK, CacheScope, PromptCache
from localctx.kvcache.prompt_cache_file import BadPromptFile

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX owners and modes")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def loose_umask():
    old = os.umask(0o000)  # the widest: anything not set explicitly would come out 0777/0666
    yield
    os.umask(old)


def another_user(monkeypatch) -> None:
    real = os.getuid()
    monkeypatch.setattr(private_files.os, "getuid", lambda: real + 1)


def test_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path, loose_umask):
    target = tmp_path / "a" / "b" / "c.json"
    write_private(target, "{}")
    assert mode(target) == 0o600 and mode(tmp_path / "a") == 0o700 and mode(tmp_path / "a" / "b") == 0o700
    assert target.read_text() == "{}" and [p.name for p in target.parent.iterdir()] == ["c.json"]
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o755)
    os.chmod(wide, 0o755)
    private_dir(wide)
    assert mode(wide) == 0o700  # a folder of this user's own, left wider, is tightened


def test_a_file_is_trusted_only_when_this_users_and_no_one_else_can_write_it_or_its_folder(tmp_path, monkeypatch):
    path = tmp_path / "f"
    write_private(path, b"x")
    assert untrusted(path) is None and untrusted(tmp_path / "missing") is None
    os.chmod(path, 0o620)
    assert "writable by its group" in untrusted(path)
    os.chmod(path, 0o606)
    assert "writable by others" in untrusted(path)
    os.chmod(path, 0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    assert "symbolic link" in untrusted(link)
    os.chmod(tmp_path, 0o777)
    assert untrusted(path).startswith("its folder is writable by others")
    os.chmod(tmp_path, 0o700)
    another_user(monkeypatch)
    assert "belongs to another user" in untrusted(path)


SCOPE = CacheScope(model_hash="b" * 64, backend="torch", policy="int8", layout="test")


def test_a_prompt_cache_file_is_written_owner_only_and_refused_once_others_could_write_it(loose_umask):
    notes: list[str] = []
    cache = PromptCache(lambda: SCOPE, notice=notes.append)
    tokens = list(range(2 * CHUNK))
    path = cache.save(tokens, {"k": np.ones((2, 3), np.float32)}, {})
    assert mode(path) == 0o600 and mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700
    assert cache.lookup(tokens + [1], limit=len(tokens)) is not None
    os.chmod(path, 0o666)
    with pytest.raises(BadPromptFile, match="not safe to load: it is writable by others"):
        prompt_cache_file.read(path)
    assert cache.lookup(tokens + [1], limit=len(tokens)) is None
    assert notes and "not safe to load" in notes[-1] and not path.exists()  # removed, said once


def test_a_calibration_another_user_owns_or_others_could_write_is_not_loaded(tmp_path, monkeypatch, loose_umask):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path / "cache"))
    cal = Calibration(backend="llamacpp", hardware_key="this-box", model="m", weight_bytes=1, bandwidth_bytes_s=5e9,
                      formats={"fp16": FormatCost(0.01, 1e-10)})
    path = calibration.save(cal)
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert calibration.load("llamacpp", "this-box").source == str(path)
    os.chmod(path, 0o646)
    assert calibration.load("llamacpp", "this-box") is None  # no default for this key either
    os.chmod(path, 0o600)
    another_user(monkeypatch)
    assert calibration.load("llamacpp", "this-box") is None


def test_a_cached_gguf_header_that_is_not_safe_is_parsed_again_and_rewritten(tmp_path, monkeypatch, loose_umask):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path / "cache"))
    model = bundled_default_path()
    gguf_header_cache.forget()
    first = gguf_header_cache.cached_header(model)
    key = gguf_header_cache.file_key(model)
    cached = gguf_header_cache.cache_path(key[0])
    assert mode(cached) == 0o600 and mode(cached.parent) == 0o700
    os.chmod(cached, 0o666)
    gguf_header_cache.forget()
    parsed = []
    real = gguf_header_cache.gguf_header.read_header
    monkeypatch.setattr(gguf_header_cache.gguf_header, "read_header", lambda p: parsed.append(p) or real(p))
    again = gguf_header_cache.cached_header(model)
    assert parsed == [model] and again.to_json() == first.to_json()  # not read from the loose file
    assert mode(cached) == 0o600  # and written back owner-only
    gguf_header_cache.forget()


def test_the_chat_history_is_owner_only_and_anothers_database_is_refused(tmp_path, monkeypatch, loose_umask):
    folder = tmp_path / "data"
    history, notice = History.open(folder / DB_NAME)
    history.close()
    assert notice is None and mode(folder / DB_NAME) == 0o600 and mode(folder) == 0o700
    os.chmod(folder / DB_NAME, 0o644)  # as an older version left it
    History.open(folder / DB_NAME)[0].close()
    assert mode(folder / DB_NAME) == 0o600
    another_user(monkeypatch)
    with pytest.raises(RuntimeFailure, match="not safe to open: it belongs to another user"):
        History.open(folder / DB_NAME)
