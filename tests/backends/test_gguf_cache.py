"""GGUF headers are parsed once per file and cached by size + mtime; the run path reads a model's
header at most once and never builds gguf's GGUFReader."""
from __future__ import annotations

import os

import pytest

from localctx.backends.models import gguf_header, gguf_header_cache
from localctx.backends.models.spec_reader import gguf_spec
from gguf_tiny import write_every_type


@pytest.fixture
def parses(monkeypatch):
    """Counts real parses of a GGUF header (each test starts with an empty in-process memo)."""
    calls = []
    real = gguf_header.read_header

    def counting(path):
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(gguf_header, "read_header", counting)
    gguf_header_cache.forget()
    yield calls
    gguf_header_cache.forget()


def test_a_second_process_reads_the_cache_not_the_file(tmp_path, parses):
    path = write_every_type(tmp_path / "m.gguf")
    first = gguf_header_cache.cached_header(path)
    assert gguf_header_cache.cached_header(path) is first and len(parses) == 1  # the in-process memo
    gguf_header_cache.forget()  # as a new process would start
    again = gguf_header_cache.cached_header(path)
    assert len(parses) == 1
    assert again.values == first.values and again.tensors == first.tensors
    assert again.get("tokenizer.ggml.tokens") == first.get("tokenizer.ggml.tokens")
    assert not list(gguf_header_cache.cache_path(str(path.resolve())).parent.glob("*.tmp"))


def test_a_changed_file_is_parsed_again(tmp_path, parses):
    path = write_every_type(tmp_path / "m.gguf")
    gguf_header_cache.cached_header(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # same size, newer mtime
    gguf_header_cache.forget()
    gguf_header_cache.cached_header(path)
    assert len(parses) == 2
    with open(path, "ab") as fh:  # same mtime, another size
        fh.write(b"\0" * 32)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    gguf_header_cache.forget()
    gguf_header_cache.cached_header(path)
    assert len(parses) == 3


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"format": 1, "path": 3}', b"[1, 2]",
                                    b'{"format": 1, "header": {}}'])
def test_a_damaged_cache_file_is_ignored_and_rewritten(tmp_path, parses, damage):
    path = write_every_type(tmp_path / "m.gguf")
    want = gguf_header_cache.cached_header(path)
    cache = gguf_header_cache.cache_path(str(path.resolve()))
    if damage == b'{"format": 1, "header": {}}':  # right key, damaged body
        import json
        st = path.stat()
        damage = json.dumps({"format": 1, "path": str(path.resolve()), "size": st.st_size,
                             "mtime_ns": st.st_mtime_ns, "header": {"values": 3}}).encode()
    cache.write_bytes(damage)
    gguf_header_cache.forget()
    got = gguf_header_cache.cached_header(path)
    assert len(parses) == 2 and got.values == want.values and got.tensors == want.tensors
    gguf_header_cache.forget()
    gguf_header_cache.cached_header(path)
    assert len(parses) == 2  # rewritten whole


def test_an_unwritable_cache_dir_only_costs_a_parse(tmp_path, parses, monkeypatch):
    path = write_every_type(tmp_path / "m.gguf")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(blocker))
    assert gguf_header_cache.cached_header(path).get("t.u8") == 200


@pytest.mark.slow
def test_the_spec_from_a_cached_header_equals_a_fresh_one(smollm2_path, parses):
    fresh = gguf_spec(smollm2_path)
    gguf_header_cache.forget()
    cached = gguf_spec(smollm2_path)
    assert len(parses) == 1 and cached == fresh
    assert fresh.vocab_size == 49152 and fresh.n_layers == 30 and fresh.weight_bytes > 50_000_000


@pytest.mark.slow
@pytest.mark.parametrize("command", [["run", "--max-tokens", "1", "hi"],
                                     ["summarize", "--summary-tokens", "16", "--json"]])
def test_the_run_path_parses_the_model_at_most_once(cli, parses, monkeypatch, tmp_path, command):
    import gguf

    def no_reader(*args, **kwargs):
        raise AssertionError("GGUFReader was built on the run path")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    args = list(command)
    if command[0] == "summarize":
        doc = tmp_path / "doc.txt"
        doc.write_text("A short note about the weather. " * 5)
        args += ["--out", str(tmp_path / "out"), str(doc)]
    first = cli(*args)
    assert first.code == 0, first.err
    assert len(parses) == 1
    gguf_header_cache.forget()  # a second run in a new process finds the cached header
    again = cli(*args)
    assert again.code == 0, again.err
    assert len(parses) == 1
