"""Tiny random-weight Llama-family models for the torch backend's tests: the same weights written
as a GGUF (with llama.cpp's q/k row permutation) and as an HF folder (safetensors +
tokenizer.json), plus an independent plain-torch forward without any cache."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s")]


def byte_chars() -> list[str]:
    """GPT-2's printable character for each byte 0..255 (written out here, not imported)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def vocab_tokens() -> list[str]:
    return byte_chars() + [a + b for a, b in MERGES] + SPECIALS


@dataclass(frozen=True)
class TinyConfig:
    arch: str = "llama"  # llama | qwen2 | qwen3
    n_layers: int = 2
    hidden: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 8
    intermediate: int = 48
    rope_base: float = 10000.0
    eps: float = 1e-5
    context: int = 512
    tie: bool = True

    @property
    def vocab(self) -> int:
        return len(vocab_tokens())


def tiny_weights(cfg: TinyConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 weights."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else 1 / math.sqrt(shape[-1]))

    w = {"model.embed_tokens.weight": rnd(cfg.vocab, cfg.hidden, scale=1.0),
         "model.norm.weight": 1 + 0.1 * rnd(cfg.hidden, scale=1.0)}
    if not cfg.tie:
        w["lm_head.weight"] = rnd(cfg.vocab, cfg.hidden)
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rnd(cfg.hidden, scale=1.0)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rnd(cfg.hidden, scale=1.0)
        w[p + "self_attn.q_proj.weight"] = rnd(q, cfg.hidden) * 2
        w[p + "self_attn.k_proj.weight"] = rnd(kv, cfg.hidden) * 2
        w[p + "self_attn.v_proj.weight"] = rnd(kv, cfg.hidden)
        w[p + "self_attn.o_proj.weight"] = rnd(cfg.hidden, q)
        w[p + "mlp.gate_proj.weight"] = rnd(cfg.intermediate, cfg.hidden)
        w[p + "mlp.up_proj.weight"] = rnd(cfg.intermediate, cfg.hidden)
        w[p + "mlp.down_proj.weight"] = rnd(cfg.hidden, cfg.intermediate)
        if cfg.arch == "qwen2":
            for n, size in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{n}_proj.bias"] = rnd(size, scale=0.5)
        if cfg.arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = 1 + 0.1 * rnd(cfg.head_dim, scale=1.0)
            w[p + "self_attn.k_norm.weight"] = 1 + 0.1 * rnd(cfg.head_dim, scale=1.0)
    return w


def tiny_tokenizer() -> Tokenizer:
    tokens = vocab_tokens()
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, MERGES))
    digits_then_gpt2 = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in digits_then_gpt2]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


_ARCH_NAMES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def write_hf(folder: Path, cfg: TinyConfig, weights: dict[str, torch.Tensor], rope_scaling: dict | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [_ARCH_NAMES[cfg.arch]], "model_type": cfg.arch, "hidden_size": cfg.hidden,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
              "intermediate_size": cfg.intermediate, "vocab_size": cfg.vocab, "rms_norm_eps": cfg.eps,
              "rope_theta": cfg.rope_base, "max_position_embeddings": cfg.context, "tie_word_embeddings": cfg.tie,
              "torch_dtype": "float32", "eos_token_id": len(vocab_tokens()) - 1, "rope_scaling": rope_scaling}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML}))
    return folder


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's HF→GGUF converter does to q/k rows for the llama architecture."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, cfg: TinyConfig, weights: dict[str, torch.Tensor], template: str = CHATML) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), cfg.arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.context)
    writer.add_embedding_length(cfg.hidden)
    writer.add_feed_forward_length(cfg.intermediate)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.eps)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_rope_dimension_count(cfg.head_dim)
    tokens = vocab_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
    for x in ("q", "k", "v"):
        layer[f"self_attn.{x}_proj.weight"] = f"attn_{x}.weight"
        layer[f"self_attn.{x}_proj.bias"] = f"attn_{x}.bias"
    for name, t in weights.items():
        arr = t.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            out = f"blk.{idx}.{layer[rest]}"
            if cfg.arch == "llama" and rest.startswith("self_attn.q_proj"):
                arr = llamacpp_permute(arr, cfg.n_heads)
            if cfg.arch == "llama" and rest.startswith("self_attn.k_proj"):
                arr = llamacpp_permute(arr, cfg.n_kv_heads)
        else:
            out = names[name]
        writer.add_tensor(out, np.ascontiguousarray(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, base: float, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H, D]; rotate-half RoPE at positions 0..T-1, written with complex numbers."""
    T, H, D = x.shape
    if inv_freq is None:
        inv_freq = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # [T, 1, D/2]
    pairs = torch.complex(x[..., :D // 2].double(), x[..., D // 2:].double()) * rot
    return torch.cat([pairs.real, pairs.imag], dim=-1).float()


def reference_logits(cfg: TinyConfig, w: dict[str, torch.Tensor], ids: list[int],
                     inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Every position's logits [T, vocab], recomputed from scratch (no cache, no shared code)."""
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    T = len(ids)
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], cfg.eps)

        def proj(n):
            out = h @ w[p + f"self_attn.{n}_proj.weight"].T
            return out + w[p + f"self_attn.{n}_proj.bias"] if p + f"self_attn.{n}_proj.bias" in w else out
        q = proj("q").view(T, cfg.n_heads, cfg.head_dim)
        k = proj("k").view(T, cfg.n_kv_heads, cfg.head_dim)
        v = proj("v").view(T, cfg.n_kv_heads, cfg.head_dim)
        if cfg.arch == "qwen3":
            q = _rms(q, w[p + "self_attn.q_norm.weight"], cfg.eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], cfg.eps)
        q, k = _rope(q, cfg.rope_base, inv_freq), _rope(k, cfg.rope_base, inv_freq)
        heads = []
        for hd in range(cfg.n_heads):
            kv_h = hd // (cfg.n_heads // cfg.n_kv_heads)
            s = q[:, hd] @ k[:, kv_h].T / math.sqrt(cfg.head_dim) + mask
            heads.append(torch.softmax(s, -1) @ v[:, kv_h])
        x = x + torch.cat(heads, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], cfg.eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return _rms(x, w["model.norm.weight"], cfg.eps) @ head.T


def greedy_without_cache(cfg: TinyConfig, w: dict[str, torch.Tensor], ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(reference_logits(cfg, w, out)[-1].argmax()))
    return out[len(ids):]
