"""A GGUF of any type the ``gguf`` package dequantizes (K-quants included) into an mlx-lm model folder:
every tensor dequantized with the shared reader (backends/models/gguf_header.py), renamed from
llama.cpp's names to mlx-lm's (Hugging Face's), llama.cpp's Q/K row permutation undone for the
``llama``/``mistral`` architectures (mlx-lm rotates halves), Gemma's stored ``1 + w`` norms back to
``w``. A quantized tensor whose values lie on an affine grid of MLX's (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K: gguf_grid.py) keeps that grid as is; other types are stored float16 (re-quantizing them
would round every value a second time). The config comes from the GGUF header. The folder (config.json +
model.safetensors, which ``mlx_lm.load`` also reads) is written owner-only into the cache directory
under the file's content hash, renamed into place whole, and checked against its manifest before it
is used again: a damaged or foreign folder is rebuilt."""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from localctx.backends.mlx.gguf_grid import GROUP, Grid, exact_grid
from localctx.backends.models.gguf_header import dequantize_f32, tensor_data
from localctx.backends.models.gguf_meta import ModelMeta
from localctx.backends.models.spec_reader import read_gguf
from localctx.kvcache import prompt_cache
from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import cache_dir
from localctx.kvcache.private_files import private_dir, untrusted, write_private

VERSION = 3  # bump when the conversion changes: older folders are then rebuilt (3: the file's own grids)
MANIFEST = "localctx-conversion.json"

# llama.cpp's architecture → mlx-lm's model file, for the families this converter maps
MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
PERMUTED = {"llama", "mistral"}  # llama.cpp's converter interleaves Q/K rows for these
_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GEMMA_BLOCK = {**_BLOCK, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def model_type(arch: str | None) -> str | None:
    return MODEL_TYPE.get(str(arch))


def converted_folder(path: Path) -> Path:
    """The mlx-lm folder for this GGUF, converted now unless a valid one is cached; says on stderr
    what was converted and how long it took."""
    key = f"{prompt_cache.model_hash(path)[:24]}-v{VERSION}"
    folder = cache_dir() / "mlx-converted" / key
    if _valid(folder, key):
        return folder
    start = time.perf_counter()
    summary = _convert(path, folder, key)
    print(f"localctx: converted {path.name} for MLX ({summary}) in {time.perf_counter() - start:.1f} s; "
          f"cached in {folder}", file=sys.stderr)
    return folder


def _digest(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _valid(folder: Path, key: str) -> bool:
    manifest = folder / MANIFEST
    if not manifest.is_file() or untrusted(manifest) or untrusted(folder / "model.safetensors"):
        return False
    try:
        data = json.loads(manifest.read_text())
        return data.get("key") == key and all(
            untrusted(folder / name) is None and _digest(folder / name) == digest
            for name, digest in data["files"].items())
    except (OSError, ValueError, KeyError, AttributeError):
        return False


# -- the conversion ---------------------------------------------------------------------------------
def config_from_gguf(meta: ModelMeta, names: set[str]) -> dict:
    """An mlx-lm (Hugging Face style) config.json from the GGUF header."""
    mtype = model_type(meta.arch)
    if mtype is None:
        raise UserError(f"--backend mlx converts GGUFs of {', '.join(sorted(MODEL_TYPE))}, not {meta.arch!r}; "
                        "use the model's safetensors folder (mlx-lm runs it) or --backend llamacpp")
    if "rope_freqs.weight" in names:
        raise UserError(f"{meta.file_name} scales RoPE with a frequency table (Llama 3.1 style), which the MLX "
                        "conversion does not carry over; use the model's safetensors folder or --backend llamacpp")
    n_heads, hidden = int(meta.need("attention.head_count")), int(meta.need("embedding_length"))
    n_layers = int(meta.need("block_count"))
    head_dim = int(meta.get("attention.key_length", hidden // n_heads))
    cfg = {
        "model_type": mtype, "hidden_size": hidden, "num_hidden_layers": n_layers,
        "intermediate_size": int(meta.need("feed_forward_length")), "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get("attention.head_count_kv", n_heads)), "head_dim": head_dim,
        "vocab_size": meta.vocab_size(), "max_position_embeddings": int(meta.need("context_length")),
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    linear = meta.linear_rope("--backend mlx")
    if linear is not None:
        cfg["rope_scaling"] = {"type": "linear", "factor": linear}
    if mtype == "gemma3_text":
        window = meta.get("attention.sliding_window")
        cfg.update(query_pre_attn_scalar=head_dim, rope_local_base_freq=10000.0, sliding_window_pattern=6,
                   sliding_window=int(window) if window else 512,
                   rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)))
    return cfg


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permute: per head, rows (pair i, half h) back to (half h, i)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, gemma: bool) -> str:
    parts = name.split(".")
    table = _GEMMA_BLOCK if gemma else _BLOCK
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    raise UserError(f"the GGUF has a tensor {name!r} that the MLX conversion does not map; "
                    "use the model's safetensors folder or --backend llamacpp")


def _convert(path: Path, folder: Path, key: str) -> str:
    reader = read_gguf(path)
    meta = ModelMeta(reader, path.name)
    names = {t.name for t in reader.tensors}
    cfg = config_from_gguf(meta, names)
    gemma = cfg["model_type"] == "gemma3_text"
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, grids, types = {}, {}, {}
    for t in reader.tensors:
        value = dequantize_f32(raw, t)
        hf = _hf_name(t.name, gemma)
        qtype = GGMLQuantizationType(t.ggml_type)
        types[qtype.name] = types.get(qtype.name, 0) + 1
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        quantized = value.ndim == 2 and hf.endswith(".weight") and block_elems > 1  # F16/F32: no grid to keep
        rows = np.asarray(tensor_data(raw, t)) if quantized else None  # [rows, bytes per row]
        if meta.arch in PERMUTED and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if "attn_q" in t.name else cfg["num_key_value_heads"]
            value = _unpermute(value, heads)
            rows = None if rows is None else _unpermute(rows, heads)  # each row's blocks move with it
        if gemma and t.name.endswith("norm.weight"):
            value = value - 1.0  # llama.cpp stores Gemma's norms as 1 + w; mlx-lm adds the 1
        weights[hf] = mx.array(value.astype(np.float16 if value.ndim > 1 else np.float32))
        if rows is not None:
            grid = exact_grid(qtype.name, rows.reshape(-1, block_bytes), value)
            if grid is not None:
                grids[hf[: -len(".weight")]] = grid
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise UserError(f"{path.name}'s tensors do not fit mlx-lm's {cfg['model_type']} model ({str(exc)[:160]})") from None
    used = _keep_grids(model, grids)
    if used:
        first = next(iter(used.values()))
        cfg["quantization"] = {**first, **used}
    _write(model, cfg, folder, key)
    bits = sorted({q["bits"] for q in used.values()})
    kept = (f"{len(used)} layers kept on their own {'/'.join(map(str, bits))}-bit grid, the rest float16"
            if used else "no grid MLX holds: every tensor float16")
    return f"{sum(types.values())} tensors of {', '.join(f'{n} {k}' for k, n in sorted(types.items()))}; {kept}"


def _keep_grids(model: nn.Module, grids: dict[str, Grid]) -> dict[str, dict]:
    """Quantizes the layers ``grids`` names and puts each one's own grid in place of what
    ``nn.quantize`` chose; returns their quantization entries for config.json."""
    nn.quantize(model, class_predicate=lambda p, m: {"group_size": GROUP, "bits": grids[p].bits}
                if p in grids and hasattr(m, "to_quantized") else False)
    used = {}
    for path, layer in _quantized_paths(model):
        grid = grids[path]
        dtype = layer.scales.dtype
        layer.weight = mx.array(grid.weight)
        layer.scales, layer.biases = mx.array(grid.scales).astype(dtype), mx.array(grid.biases).astype(dtype)
        used[path] = {"group_size": GROUP, "bits": grid.bits}
    return used


def _quantized_paths(model: nn.Module):
    return ((p, m) for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)))


def _write(model: nn.Module, cfg: dict, folder: Path, key: str) -> None:
    from mlx.utils import tree_flatten

    parent = private_dir(folder.parent)
    tmp = parent / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    private_dir(tmp)
    weights = dict(tree_flatten(model.parameters()))
    target = tmp / "model.safetensors"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    mx.save_safetensors(str(target), weights, metadata={"format": "mlx"})
    os.chmod(target, 0o600)
    write_private(tmp / "config.json", json.dumps(cfg, indent=1))
    files = {name: _digest(tmp / name) for name in ("model.safetensors", "config.json")}
    write_private(tmp / MANIFEST, json.dumps({"key": key, "files": files}))
    shutil.rmtree(folder, ignore_errors=True)  # a damaged or older folder under this key
    os.replace(tmp, folder)
