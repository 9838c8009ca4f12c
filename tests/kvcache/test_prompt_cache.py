"""The prompt cache on disk, without a model: file format, checksums, scopes, atomic writes, LRU,
and `localctx cache ls|rm|clear`."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from localctx.kvcache import private_files, prompt_cache, prompt_cache_file
from localctx.kvcache.prompt_cache import (CHUNK, MIN_TOKENS, CacheScope, PromptCache, chunk_hashes, exact_save_point,
                                           save_point)
from localctx.kvcache.prompt_cache_file import BadPromptFile

SCOPE = CacheScope(model_hash="a" * 64, backend="torch", policy="int4", layout="policy|float32|2x1x32")


def store(scope: CacheScope = SCOPE, notes: list | None = None) -> PromptCache:
    return PromptCache(lambda: scope, notice=(notes.append if notes is not None else lambda line: None))


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


def payload(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    return {"full_k": rng.standard_normal((2, n, 1, 32)).astype(np.float32),
            "qk_codes": rng.integers(0, 255, (2, n // 32, 1, 32, 16), dtype=np.uint8),
            "n_seen": np.array([n, 0], dtype=np.int64)}


def test_a_saved_prefix_is_found_for_a_longer_prompt_and_round_trips_bit_exact():
    s = store()
    doc = tokens(3 * CHUNK)
    s.save(doc[:2 * CHUNK], payload(2 * CHUNK), {})
    hit = s.lookup(doc + [1, 2, 3], limit=len(doc) + 2)
    assert hit is not None and hit.n_tokens == 2 * CHUNK
    for name, arr in payload(2 * CHUNK).items():
        assert np.array_equal(hit.file.tensors[name], arr)
    # a prompt that shares only the first chunk can use one chunk of it (when the cache can be cut)
    other = doc[:CHUNK] + tokens(2 * CHUNK, seed=9)
    assert s.lookup(other, limit=len(other) - 1).n_tokens == CHUNK
    assert s.lookup(other, limit=len(other) - 1, whole_only=True) is None
    assert s.lookup(tokens(3 * CHUNK, seed=5), limit=3 * CHUNK - 1) is None


def test_a_prefix_that_ends_mid_chunk_is_used_to_the_first_differing_token():
    s = store()
    doc = tokens(3 * CHUNK)
    n_file = 2 * CHUNK + 300  # a file saved at no chunk boundary (all of a prompt but its last token)
    s.save(doc[:n_file], payload(n_file), {})
    # the prompt leaves the file mid-chunk, 123 tokens into its last (partial) chunk
    edited = doc[:2 * CHUNK + 123] + [doc[2 * CHUNK + 123] + 1] + doc[2 * CHUNK + 124:]
    assert s.lookup(edited, limit=len(edited) - 1).n_tokens == 2 * CHUNK + 123
    assert s.lookup(edited, limit=len(edited) - 1, whole_only=True) is None
    # ... and mid-way through a whole chunk
    edited = doc[:CHUNK + 77] + tokens(2 * CHUNK, seed=11)
    assert s.lookup(edited, limit=len(edited) - 1).n_tokens == CHUNK + 77
    # the limit caps what is used (the prompt's last token is always evaluated again)
    assert s.lookup(doc[:n_file], limit=n_file - 1).n_tokens == n_file - 1
    assert s.lookup(doc[:n_file], limit=n_file - 1, whole_only=True) is None
    hit = s.lookup(doc[:n_file + 1], limit=n_file, whole_only=True)
    assert hit.n_tokens == n_file and np.array_equal(hit.file.tensors["tokens"], doc[:n_file])
    # of two files the one sharing more tokens wins, though both share the same whole chunks
    s.save(doc[:2 * CHUNK + 50] + tokens(400, seed=3), payload(2 * CHUNK + 450), {})
    assert s.lookup(doc, limit=len(doc) - 1).n_tokens == n_file
    assert s.lookup(doc[:2 * CHUNK + 50] + tokens(400, seed=3) + [7], limit=2 * CHUNK + 450).n_tokens == 2 * CHUNK + 450


def test_the_file_is_valid_safetensors_with_its_metadata():
    safetensors = pytest.importorskip("safetensors.numpy")
    s = store()
    path = s.save(tokens(CHUNK), payload(CHUNK), {"kv_bytes": "123"})
    loaded = safetensors.load_file(str(path))
    assert np.array_equal(loaded["full_k"], payload(CHUNK)["full_k"])
    header, _ = prompt_cache_file.read_header(path)
    assert header["__metadata__"]["scope_policy"] == "int4"
    assert header["__metadata__"]["kv_bytes"] == "123"


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_file_is_never_used_and_is_removed_with_one_notice(damage):
    notes: list[str] = []
    s = store(notes=notes)
    doc = tokens(2 * CHUNK)
    path = s.save(doc[:CHUNK], payload(CHUNK), {})
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01
    elif damage == "truncate":
        data = data[:len(data) - 1000]
    else:
        data[10] = ord("{")
    path.write_bytes(bytes(data))
    assert s.lookup(doc, limit=len(doc) - 1) is None
    assert len(notes) == 1 and path.name in notes[0]
    assert not path.exists()


@pytest.mark.parametrize("field", ["model_hash", "backend", "policy", "layout"])
def test_a_file_made_for_another_model_backend_policy_or_layout_is_never_used(field):
    doc = tokens(2 * CHUNK)
    other = CacheScope(**{**SCOPE.__dict__, field: "something else"})
    written = store(other).save(doc[:CHUNK], payload(CHUNK), {})
    # copied (or renamed) into this scope's folder, its metadata still names the other scope
    target = store().folder / written.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(written.read_bytes())
    notes: list[str] = []
    assert store(notes=notes).lookup(doc, limit=len(doc) - 1) is None
    assert "another model" in notes[0]


def test_a_kill_mid_write_leaves_nothing_that_loads(tmp_path):
    """A child process is killed (SIGKILL) between writing the data and the rename."""
    cache_dir = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        os.environ["LOCALCTX_CACHE_DIR"] = {str(cache_dir)!r}
        from localctx.kvcache import prompt_cache_file
        from localctx.kvcache.prompt_cache import CacheScope, PromptCache
        real_replace = os.replace
        def killed(src, dst):
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = killed
        scope = CacheScope("a" * 64, "torch", "int4", "policy|float32|2x1x32")
        PromptCache(lambda: scope).save(list(range({CHUNK})), {{"full_k": np.ones((2, {CHUNK}, 1, 32), np.float32)}}, {{}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    left = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert left and all(p.name.endswith(".tmp") for p in left)  # only the temp file, which nothing reads
    import os
    os.environ["LOCALCTX_CACHE_DIR"] = str(cache_dir)
    try:
        assert store().lookup(list(range(CHUNK)) + [1], limit=CHUNK) is None
        assert prompt_cache.entries() == []
    finally:
        del os.environ["LOCALCTX_CACHE_DIR"]


def test_an_exception_before_the_rename_removes_the_temp_file(monkeypatch):
    def fail(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(private_files.os, "replace", fail)  # the writer every cache file goes through
    s = store()
    with pytest.raises(OSError):
        s.save(tokens(CHUNK), payload(CHUNK), {})
    assert not any(s.folder.iterdir())


def test_least_recently_used_files_go_first_when_over_budget(monkeypatch):
    s = store()
    docs = [tokens(CHUNK, seed=i) for i in range(3)]
    paths = [s.save(d, payload(CHUNK), {}) for d in docs]
    size = paths[0].stat().st_size
    import os
    for i, p in enumerate(paths):
        os.utime(p, (1000 + i, 1000 + i))
    assert s.lookup(docs[0] + [1], limit=CHUNK) is not None  # a hit makes file 0 the newest
    monkeypatch.setenv(prompt_cache.BUDGET_ENV, str(2 * size + 10))
    s.save(tokens(CHUNK, seed=7), payload(CHUNK), {})
    assert paths[0].exists() and not paths[1].exists() and not paths[2].exists()
    assert sum(e.size for e in prompt_cache.entries()) <= 2 * size + 10


def test_save_points_are_chunk_boundaries_after_whole_chunks():
    assert save_point(CHUNK, 0) == 0  # the boundary must leave one token to prefill after it
    assert save_point(CHUNK + 1, 0) == CHUNK
    assert save_point(8200, 0) == 16 * CHUNK
    assert save_point(8200, 16 * CHUNK) == 0  # already there
    assert save_point(8200, 1000) == 0  # prefill from 1000 does not run in the cold run's chunks
    assert save_point(8200, 2 * CHUNK) == 16 * CHUNK
    assert len(chunk_hashes(tokens(3 * CHUNK + 5))) == 3


def test_exact_save_points_keep_all_but_the_last_token_when_that_adds_a_chunk():
    assert exact_save_point(MIN_TOKENS, 0) == 0  # too short to be worth a file
    assert exact_save_point(MIN_TOKENS + 1, 0) == MIN_TOKENS
    assert exact_save_point(7622, 0) == 7621
    assert exact_save_point(7622, 1000) == 7621  # any reused length: the cache is cut anywhere
    assert exact_save_point(7622, 7500) == 0  # a second question: no second copy of the document
    assert exact_save_point(7622, 7621 - CHUNK) == 7621


def test_model_hash_is_of_the_content_and_remembered_per_file_version(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 1000)
    h1 = prompt_cache.model_hash(f)
    assert h1 == prompt_cache.model_hash(f)
    f.write_bytes(b"y" * 1000)  # same size, new content (and a new mtime)
    import os
    os.utime(f, ns=(1, 1))
    assert prompt_cache.model_hash(f) != h1


def test_cache_cli_lists_removes_and_clears(cli):
    s = store()
    paths = [s.save(tokens(CHUNK, seed=i), payload(CHUNK), {}) for i in range(2)]
    out = cli("cache", "ls", "--json")
    rows = json.loads(out.out)["entries"]
    assert {r["tokens"] for r in rows} == {CHUNK} and len(rows) == 2
    assert cli("cache", "rm", rows[0]["name"]).code == 0
    assert sum(p.exists() for p in paths) == 1
    bad = cli("cache", "rm", "nope/nothing")
    assert bad.code != 0 and "no cached prompt" in bad.err
    assert cli("cache", "clear").code == 0
    assert not any(p.exists() for p in paths)
    assert "0 cached prompts" in cli("cache", "ls").out
