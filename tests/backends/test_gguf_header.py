"""The fast GGUF header reader against the gguf package's GGUFReader, and its errors on bad files."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from localctx.backends.models import gguf_header
from localctx.backends.models.gguf_header import read_header
from localctx.kvcache.errors import UserError

from gguf_tiny import write_every_type


def assert_matches_gguf_reader(path):
    from gguf import GGUFReader

    ref = GGUFReader(str(path))
    mine = read_header(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert sorted(mine.keys()) == sorted(keys)
    for key in keys:
        want = ref.fields[key].contents()
        got = mine.get(key)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        elif isinstance(want, list) and want and isinstance(want[0], float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
        if isinstance(want, list):
            assert mine.array_length(key) == len(want), key
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(mine.tensors, ref.tensors):
        assert t.shape == tuple(int(d) for d in r.shape.tolist()), t.name
        assert t.ggml_type == int(r.tensor_type), t.name
        assert (t.n_elements, t.n_bytes, t.data_offset) == (int(r.n_elements), int(r.n_bytes), int(r.data_offset))
    return mine, ref


@pytest.mark.parametrize("endian", ["little", "big"])
def test_every_value_type_array_and_tensor_matches_gguf_reader(tmp_path, endian):
    mine, _ = assert_matches_gguf_reader(write_every_type(tmp_path / "all.gguf", endian))
    assert mine.get("t.u64") == 2**63 + 5 and mine.get("t.bool") is True
    # the tokenizer's arrays stay in the file until asked for; the chat template is kept
    assert set(mine.arrays) == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
                                "tokenizer.ggml.merges"}
    assert "tokenizer.chat_template" in mine.values
    assert mine.array_length("tokenizer.ggml.tokens") == 301
    assert mine.get("no.such.key", "dflt") == "dflt" and mine.array_length("no.such.key") is None


def test_arrays_longer_than_the_keep_limit_are_read_on_demand(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_header, "KEEP_ITEMS", 2)
    mine = read_header(write_every_type(tmp_path / "all.gguf"))
    assert "t.ints" in mine.arrays and "t.strs" in mine.arrays and "t.floats" in mine.values
    assert mine.get("t.ints") == [1, 2, 3] and mine.get("t.strs") == ["a", "", "ünïcode"]


@pytest.mark.slow
def test_the_bundled_smollm2_matches_gguf_reader(smollm2_path):
    mine, ref = assert_matches_gguf_reader(smollm2_path)
    assert mine.array_length("tokenizer.ggml.tokens") == 49152 == len(ref.fields["tokenizer.ggml.tokens"].data)
    assert len(mine.tensors) == len(ref.tensors) > 100


def test_json_round_trip_keeps_everything(tmp_path):
    from localctx.backends.models.gguf_header import GGUFHeader

    mine = read_header(write_every_type(tmp_path / "all.gguf"))
    back = GGUFHeader.from_json(mine.path, mine.to_json())
    assert back.values == mine.values and back.arrays == mine.arrays and back.tensors == mine.tensors
    assert back.get("tokenizer.ggml.merges") == ["t o", "to k"]


def test_every_truncation_is_a_one_line_user_error(tmp_path):
    path = write_every_type(tmp_path / "all.gguf", n_tokens=20)
    data = path.read_bytes()
    last = read_header(path).tensors[-1]
    cut = tmp_path / "cut.gguf"
    end = last.data_offset + last.n_bytes  # past that only the writer's padding is lost
    for keep in sorted(set(range(0, 160)) | set(range(160, end, 5)) | set(range(end - 40, end))):
        cut.write_bytes(data[:keep])
        with pytest.raises(UserError) as err:
            read_header(cut)
        msg = str(err.value)
        assert "truncated or corrupt" in msg and "download it again" in msg and "\n" not in msg, (keep, msg)


def _header_bytes(kv: bytes, n_kv: int, n_tensors: int = 0, tensors: bytes = b"", version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kv + tensors


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


CORRUPT = {
    "huge string length": _header_bytes(struct.pack("<Q", 2**63) + b"k", 1),
    "unknown value type": _header_bytes(_s("k") + struct.pack("<I", 99) + b"\0" * 8, 1),
    "huge numeric array": _header_bytes(_s("k") + struct.pack("<IIQ", 9, 4, 2**61), 1),
    "huge string array": _header_bytes(_s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**62)
                                       + _s("a") * 3, 1),
    "huge nested array": _header_bytes(_s("k") + struct.pack("<IIQ", 9, 9, 2**60) + b"\0" * 40, 1),
    "huge kv count": _header_bytes(_s("k") + struct.pack("<I", 4) + b"\0" * 4, 2**63),
    "huge tensor count": _header_bytes(b"", 0, 2**62, _s("w") + struct.pack("<IQIQ", 1, 32, 0, 0)),
    "too many dims": _header_bytes(b"", 0, 1, _s("w") + struct.pack("<I", 9) + b"\0" * 80),
    "tensor past the end": _header_bytes(b"", 0, 1, _s("w") + struct.pack("<IQIQ", 1, 1024, 0, 0)),
    "alignment not a power of two": _header_bytes(_s("general.alignment") + struct.pack("<II", 4, 24), 1),
    "duplicate tensor names": _header_bytes(b"", 0, 2, (_s("w") + struct.pack("<IQIQ", 1, 8, 0, 0)) * 2)
    + b"\0" * 64,
    "rows not whole blocks": _header_bytes(b"", 0, 1, _s("w") + struct.pack("<IQIQ", 1, 33, 8, 0) + b"\0" * 200),
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_corrupt_lengths_are_a_user_error_not_a_hang(tmp_path, name):
    path = tmp_path / "bad.gguf"
    path.write_bytes(CORRUPT[name])
    with pytest.raises(UserError, match="truncated or corrupt .*download it again"):
        read_header(path)


def test_not_gguf_old_version_and_unknown_tensor_type(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(UserError, match="not a GGUF file"):
        read_header(path)
    path.write_bytes(_header_bytes(b"", 0, version=1))
    with pytest.raises(UserError, match="GGUF version 1"):
        read_header(path)
    path.write_bytes(_header_bytes(b"", 0, 1, _s("w") + struct.pack("<IQIQ", 1, 32, 250, 0)) + b"\0" * 64)
    with pytest.raises(UserError, match="ggml type 250"):
        read_header(path)


def test_a_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot read model file"):
        read_header(tmp_path / "gone.gguf")
