"""Load an HF model folder (config.json + *.safetensors) into the torch model. Pickled weights
(.bin / .pt) are refused: loading them can run arbitrary code."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from localctx.backends.models.spec_reader import load_hf_config
from localctx.backends.torch.config import LlamaConfig
from localctx.backends.torch.rope import RopeScaling
from localctx.kvcache.errors import UserError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def read_config(folder: Path) -> LlamaConfig:
    cfg, arch = load_hf_config(folder)
    n_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return LlamaConfig(
        architecture=arch, n_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden, n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_base=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=RopeScaling.from_hf(cfg.get("rope_scaling")),
        qkv_bias=bool(cfg.get("attention_bias", arch == "qwen2")), qk_norm=arch == "qwen3",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def rename(hf_name: str) -> str | None:
    """HF tensor name → the torch backend's (GGUF) name; None for tensors the model does not use."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = _LAYER.match(hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def load_hf(folder: Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in folder.glob(pattern))
        if pickled:
            raise UserError(f"{folder} holds only pickled weights ({', '.join(pickled[:3])}), which localctx never "
                            "loads (unpickling can run code); convert them to .safetensors first")
        raise UserError(f"{folder} has no .safetensors weights; give a folder with config.json and *.safetensors")
    config = read_config(folder)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    ours = rename(name)
                    if ours is not None:
                        tensors[ours] = fh.get_tensor(name).to(dtype)
        except Exception as exc:  # safetensors raises its own error types on damaged files
            raise UserError(f"{path.name} is not a readable safetensors file ({str(exc)[:80]}); "
                            "download it again") from None
    return config, tensors
