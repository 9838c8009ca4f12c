"""Load a Llama-family GGUF into the torch model: metadata → LlamaConfig, tensors dequantised with
the ``gguf`` package, and llama.cpp's Q/K row permutation undone (its converter interleaves the
rotary halves of each head for the ``llama`` architecture; the torch model rotates halves)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from localctx.backends.models.gguf_header import TensorInfo, dequantize_f32
from localctx.backends.models.gguf_meta import ModelMeta
from localctx.backends.models.spec_reader import NATIVE_GRAPH, read_gguf
from localctx.backends.torch.config import LlamaConfig
from localctx.backends.torch.rope import RopeScaling
from localctx.kvcache.errors import UserError
from localctx.kvcache.model_spec import ModelSpec

# architectures whose GGUF converter permutes the q/k rows (Qwen's converters do not)
PERMUTED_ARCHS = {"llama", "mistral"}


def unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of the converter's permute: per head, rows (pair i, half h) go back to (half h, i)."""
    out_rows = weight.shape[0]
    rest = weight.shape[1:]
    return (weight.reshape(n_heads, out_rows // n_heads // 2, 2, *rest)
            .transpose(1, 2).reshape(out_rows, *rest))


def read_config(reader, path: Path) -> LlamaConfig:
    meta = ModelMeta(reader, path.name)
    if meta.arch not in NATIVE_GRAPH:
        raise UserError(f"unsupported architecture {meta.arch!r} in {path.name}; the torch backend runs the Llama "
                        f"family ({', '.join(sorted(NATIVE_GRAPH))}); run it with --backend llamacpp")
    n_heads = int(meta.need("attention.head_count"))
    hidden = int(meta.need("embedding_length"))
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        architecture=meta.arch, n_layers=int(meta.need("block_count")), hidden_size=hidden, n_heads=n_heads,
        n_kv_heads=int(meta.get("attention.head_count_kv", n_heads)),
        head_dim=int(meta.get("attention.key_length", hidden // n_heads)),
        intermediate_size=int(meta.need("feed_forward_length")), vocab_size=meta.vocab_size(),
        context_length=int(meta.need("context_length")),
        norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(meta.get("rope.freq_base", 10000.0)), rope_scaling=RopeScaling.from_gguf(meta),
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        tie_embeddings="output.weight" not in names)


def dequantize(weights: np.ndarray, tensor: TensorInfo) -> torch.Tensor:
    """One GGUF tensor as float32 in [rows, cols], writable (see gguf_header.dequantize_f32)."""
    return torch.from_numpy(dequantize_f32(weights, tensor))


def spec_from(path: Path, name: str) -> ModelSpec:
    """The ModelSpec of a loaded GGUF, per layer, from the header read_gguf already parsed (cached)."""
    from localctx.backends.models.spec_reader import gguf_spec

    return gguf_spec(path, name)


def load_gguf(path: Path, dtype: torch.dtype = torch.float32, reader=None
              ) -> tuple[LlamaConfig, dict[str, torch.Tensor], torch.Tensor | None, object]:
    """(config, tensors by GGUF name in the HF layout and in ``dtype``, rope frequency factors or
    None, the file's header from read_gguf). Each tensor is converted as it is read, so a
    half-precision load never holds the whole model in float32."""
    reader = reader or read_gguf(path)
    config = read_config(reader, path)
    tensors: dict[str, torch.Tensor] = {}
    freq_factors = None
    weights = np.memmap(path, dtype=np.uint8, mode="r")
    for t in reader.tensors:
        value = dequantize(weights, t)
        if t.name == "rope_freqs.weight":
            freq_factors = value.reshape(-1)
            continue
        if config.architecture in PERMUTED_ARCHS and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            value = unpermute_rows(value, config.n_heads)
        elif config.architecture in PERMUTED_ARCHS and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            value = unpermute_rows(value, config.n_kv_heads)
        tensors[t.name] = value.to(dtype)
    return config, tensors, freq_factors, reader
