"""The GGUF metadata reader the spec reader and the model pages share: keys under the
architecture's prefix, required keys as one-line errors, the vocabulary size without reading the
vocabulary, and RoPE scaling kinds."""
from __future__ import annotations

from pathlib import Path

import pytest

from localctx.backends.models.gguf_header import STRING, ArrayRef, GGUFHeader
from localctx.backends.models.gguf_meta import ModelMeta
from localctx.kvcache.errors import UserError


def meta(values: dict, arrays: dict | None = None) -> ModelMeta:
    # the path does not exist: anything that tried to read the file would fail
    header = GGUFHeader(Path("/nonexistent/m.gguf"), 0, 3, 32, 0, values, arrays or {}, [])
    return ModelMeta(header, "m.gguf")


def test_keys_are_read_under_the_architecture_with_defaults():
    m = meta({"general.architecture": "qwen2", "qwen2.block_count": 24, "block_count": 7})
    assert m.arch == "qwen2"
    assert m.get("block_count") == 24 and m.need("block_count") == 24
    assert m.get("context_length") is None and m.get("context_length", 4096) == 4096


def test_a_missing_required_key_is_a_one_line_error_naming_it():
    with pytest.raises(UserError) as err:
        meta({"general.architecture": "llama"}).need("feed_forward_length")
    assert str(err.value) == "m.gguf lacks llama.feed_forward_length in its metadata; the file is incomplete"


def test_vocab_size_from_the_key_else_the_vocabulary_length_unread():
    tokens = {"tokenizer.ggml.tokens": ArrayRef(STRING, 49152, 1234)}
    assert meta({"general.architecture": "llama", "llama.vocab_size": 32000}, tokens).vocab_size() == 32000
    assert meta({"general.architecture": "llama"}, tokens).vocab_size() == 49152
    assert meta({"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "b", "c"]}).vocab_size() == 3
    assert meta({"general.architecture": "llama"}).vocab_size() == 0


@pytest.mark.parametrize("values, want", [({}, None), ({"gemma3.rope.scaling.type": "none"}, None),
                                          ({"gemma3.rope.scaling.type": ""}, None),
                                          ({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}, 8.0),
                                          ({"gemma3.rope.scaling.type": "linear"}, 1.0)])
def test_linear_rope_factor(values, want):
    assert meta({"general.architecture": "gemma3", **values}).linear_rope("the torch backend") == want


def test_other_rope_scaling_is_an_error_naming_the_engine():
    m = meta({"general.architecture": "llama", "llama.rope.scaling.type": "yarn"})
    with pytest.raises(UserError, match=r"^m\.gguf uses RoPE scaling 'yarn', which --backend mlx does not run; "
                                        r"use --backend llamacpp for this model$"):
        m.linear_rope("--backend mlx")
