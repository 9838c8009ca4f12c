"""Read a ModelSpec from GGUF metadata or config.json without loading weights."""
from __future__ import annotations

import json
from pathlib import Path

from localctx.backends.modelref import ModelRef
from localctx.kvcache.errors import UserError
from localctx.kvcache.spec import ModelSpec

# architectures whose graph is the Llama family's (GQA attention + RoPE + SwiGLU MLP + RMSNorm)
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3"}
_HF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3"}


def read_spec(ref: ModelRef) -> ModelSpec:
    if ref.kind == "gguf":
        return gguf_spec(ref.path, ref.name)
    if ref.kind == "hf":
        return hf_spec(ref.path, ref.name)
    raise UserError(f"no spec reader for model kind {ref.kind!r}")


def read_gguf(path: Path):
    """``path``'s GGUF header (metadata + tensor infos, no tensor data), parsed at most once per file
    and cached by size + mtime (backends/gguf_cache.py); a truncated or corrupt file is a UserError."""
    from localctx.backends.gguf_cache import cached_header

    return cached_header(path)


def gguf_field(reader, key: str, default=None):
    """A metadata value of a header from ``read_gguf`` (big arrays are read from the file on demand)."""
    return reader.get(key, default)


def gguf_spec(path: Path, name: str | None = None) -> ModelSpec:
    reader = read_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if not arch:
        raise UserError(f"{path} has no general.architecture in its metadata; it is not a model GGUF")
    if arch not in LLAMA_FAMILY:
        raise UserError(f"unsupported architecture {arch!r} in {path.name}; localctx runs the Llama family "
                        f"({', '.join(sorted(LLAMA_FAMILY))})")

    def need(key: str):
        value = gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise UserError(f"{path.name} lacks {arch}.{key} in its metadata; the file is incomplete")
        return value

    n_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    n_kv = int(gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // n_heads))
    vocab = int(gguf_field(reader, f"{arch}.vocab_size", reader.array_length("tokenizer.ggml.tokens") or 0))
    weight_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    return ModelSpec(
        name=name or str(gguf_field(reader, "general.name", path.stem)), architecture=arch,
        n_layers=int(need("block_count")), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        hidden_size=hidden, vocab_size=vocab, context_length=int(need("context_length")),
        rope_base=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        weight_bytes=weight_bytes, n_params=n_params, kv_elem_bytes=2,
        intermediate_size=int(gguf_field(reader, f"{arch}.feed_forward_length", 0)))


def load_hf_config(folder: Path) -> tuple[dict, str]:
    """config.json and the localctx architecture name it maps to; one-line errors otherwise."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{folder}/config.json cannot be read ({exc}); fix or replace it") from None
    archs = cfg.get("architectures") or []
    arch = next((_HF_ARCH[a] for a in archs if a in _HF_ARCH), None)
    if arch is None:
        raise UserError(f"unsupported architecture {archs or cfg.get('model_type')} in {folder}; localctx "
                        f"runs {', '.join(sorted(_HF_ARCH))}")
    return cfg, arch


def hf_spec(folder: Path, name: str | None = None) -> ModelSpec:
    cfg, arch = load_hf_config(folder)
    n_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = " (it has pickled weights, which localctx does not load)" if pickled else ""
        raise UserError(f"{folder} has no .safetensors weights{hint}; convert them to safetensors")
    dtype = str(cfg.get("torch_dtype", "bfloat16"))
    elem = 4 if "32" in dtype else 2
    weight_bytes = sum(p.stat().st_size for p in weights)
    return ModelSpec(
        name=name or folder.name, architecture=arch, n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads, n_kv_heads=int(cfg.get("num_key_value_heads", n_heads)), head_dim=head_dim,
        hidden_size=hidden, vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        rope_base=float(cfg.get("rope_theta", 10000.0)), weight_bytes=weight_bytes,
        n_params=weight_bytes // elem, kv_elem_bytes=elem,
        intermediate_size=int(cfg.get("intermediate_size", 0)))
