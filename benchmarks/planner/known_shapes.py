"""Writes the newer entries of assets/models.json from the published config.json fields of each model
(named in ``source``). Run: python benchmarks/planner/known_shapes.py (rewrites those entries in place).

n_params is counted from the config's shapes (kvcache/layouts.py ``config_params``: embeddings,
attention projections, MLP or routed experts, an untied output head; norms and biases left out).
weight_bytes: bf16 = 2 bytes a parameter; Q4_0 = ggml's 18-byte blocks of 32 weights for every
matrix (what a Q4_0 GGUF stores, norms aside); gpt-oss as published: routed experts in MXFP4
(17 bytes per 32 weights), the rest bf16."""
from __future__ import annotations

import json
from pathlib import Path

from localctx.kvcache.layouts import config_params

ROOT = Path(__file__).resolve().parents[2]

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "rope_theta": 500000.0}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "rope_theta": 1000000.0,
         "max_position_embeddings": 40960, "head_dim": 128}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "rope_theta": 1000000.0, "tie_word_embeddings": True,
          "sliding_window_pattern": 6}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "vocab_size": 201088,
           "max_position_embeddings": 131072, "rope_theta": 150000.0, "sliding_window": 128,
           "experts_per_token": 4}
SMOL = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "rope_theta": 100000.0}

# key → (hub id, config.json fields, weight format)
CONFIGS = {
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B-Instruct", {**LLAMA, "hidden_size": 2048, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
                     "max_position_embeddings": 131072, "tie_word_embeddings": True}, "bf16"),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B-Instruct", {**LLAMA, "hidden_size": 3072, "num_hidden_layers": 28,
                     "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192,
                     "max_position_embeddings": 131072, "tie_word_embeddings": True}, "bf16"),
    "llama-3.3-70b-q4": ("meta-llama/Llama-3.3-70B-Instruct", {**LLAMA, "hidden_size": 8192, "num_hidden_layers": 80,
                         "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                         "intermediate_size": 28672, "max_position_embeddings": 131072}, "Q4_0"),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B-Instruct", {**QWEN2, "hidden_size": 1536, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
                     "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True}, "bf16"),
    "qwen2.5-3b": ("Qwen/Qwen2.5-3B-Instruct", {**QWEN2, "hidden_size": 2048, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "intermediate_size": 11008,
                   "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True}, "bf16"),
    "qwen2.5-14b-q4": ("Qwen/Qwen2.5-14B-Instruct", {**QWEN2, "hidden_size": 5120, "num_hidden_layers": 48,
                       "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 13824,
                       "vocab_size": 152064, "max_position_embeddings": 32768}, "Q4_0"),
    "qwen2.5-32b-q4": ("Qwen/Qwen2.5-32B-Instruct", {**QWEN2, "hidden_size": 5120, "num_hidden_layers": 64,
                       "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
                       "vocab_size": 152064, "max_position_embeddings": 32768}, "Q4_0"),
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", {**QWEN3, "hidden_size": 1024, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 3072,
                   "tie_word_embeddings": True}, "bf16"),
    "qwen3-4b": ("Qwen/Qwen3-4B", {**QWEN3, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 9728, "tie_word_embeddings": True}, "bf16"),
    "qwen3-8b": ("Qwen/Qwen3-8B", {**QWEN3, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 12288}, "bf16"),
    "qwen3-14b-q4": ("Qwen/Qwen3-14B", {**QWEN3, "hidden_size": 5120, "num_hidden_layers": 40,
                     "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 17408}, "Q4_0"),
    "qwen3-32b-q4": ("Qwen/Qwen3-32B", {**QWEN3, "hidden_size": 5120, "num_hidden_layers": 64,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 25600}, "Q4_0"),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8}, "Q4_0"),
    "gemma-3-1b": ("google/gemma-3-1b-it", {**GEMMA3, "hidden_size": 1152, "num_hidden_layers": 26,
                   "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
                   "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512}, "bf16"),
    "gemma-3-4b": ("google/gemma-3-4b-it", {**GEMMA3, "hidden_size": 2560, "num_hidden_layers": 34,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 10240,
                   "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 1024}, "bf16"),
    "gemma-3-12b-q4": ("google/gemma-3-12b-it", {**GEMMA3, "hidden_size": 3840, "num_hidden_layers": 48,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                       "intermediate_size": 15360, "vocab_size": 262208, "max_position_embeddings": 131072,
                       "sliding_window": 1024}, "Q4_0"),
    "gemma-3-27b": ("google/gemma-3-27b-it", {**GEMMA3, "hidden_size": 5376, "num_hidden_layers": 62,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504,
                    "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 1024}, "Q4_0"),
    "gpt-oss-20b": ("openai/gpt-oss-20b", {**GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32},
                    "MXFP4 experts + bf16"),
    "gpt-oss-120b": ("openai/gpt-oss-120b", {**GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128},
                     "MXFP4 experts + bf16"),
    "mistral-small-3-24b-q4": ("mistralai/Mistral-Small-24B-Instruct-2501", {
        "architectures": ["MistralForCausalLM"], "hidden_size": 5120, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 32768,
        "vocab_size": 131072, "max_position_embeddings": 32768, "rope_theta": 100000000.0}, "Q4_0"),
    "phi-4-q4": ("microsoft/phi-4", {"architectures": ["Phi3ForCausalLM"], "hidden_size": 5120, "num_hidden_layers": 40,
                 "num_attention_heads": 40, "num_key_value_heads": 10, "intermediate_size": 17920,
                 "vocab_size": 100352, "max_position_embeddings": 16384, "rope_theta": 250000.0}, "Q4_0"),
    "deepseek-r1-distill-qwen-1.5b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", {
        **QWEN2, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "intermediate_size": 8960, "vocab_size": 151936, "max_position_embeddings": 131072,
        "rope_theta": 10000.0}, "bf16"),
    "deepseek-r1-distill-qwen-7b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", {
        **QWEN2, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 131072,
        "rope_theta": 10000.0}, "bf16"),
    "deepseek-r1-distill-qwen-14b-q4": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", {
        **QWEN2, "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
        "intermediate_size": 13824, "vocab_size": 152064, "max_position_embeddings": 131072}, "Q4_0"),
    "deepseek-r1-distill-qwen-32b-q4": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", {
        **QWEN2, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
        "intermediate_size": 27648, "vocab_size": 152064, "max_position_embeddings": 131072}, "Q4_0"),
    "deepseek-r1-distill-llama-8b": ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", {
        **LLAMA, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "max_position_embeddings": 131072}, "bf16"),
    "deepseek-r1-distill-llama-70b-q4": ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", {
        **LLAMA, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 28672, "max_position_embeddings": 131072}, "Q4_0"),
    "smollm2-360m": ("HuggingFaceTB/SmolLM2-360M-Instruct", {**SMOL, "hidden_size": 960, "num_hidden_layers": 32,
                     "num_attention_heads": 15, "num_key_value_heads": 5, "intermediate_size": 2560}, "bf16"),
    "smollm2-1.7b": ("HuggingFaceTB/SmolLM2-1.7B-Instruct", {**SMOL, "hidden_size": 2048, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 8192,
                     "rope_theta": 130000.0}, "bf16"),
    "smollm3-3b": ("HuggingFaceTB/SmolLM3-3B", {"architectures": ["SmolLM3ForCausalLM"], "hidden_size": 2048,
                   "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
                   "intermediate_size": 11008, "vocab_size": 128256, "max_position_embeddings": 65536,
                   "rope_theta": 5000000.0, "tie_word_embeddings": True}, "bf16"),
}

ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3moe", "Gemma3ForCausalLM": "gemma3", "GptOssForCausalLM": "gpt-oss",
        "MistralForCausalLM": "llama", "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3"}


def weight_bytes(fmt: str, params: int, experts: int) -> int:
    if fmt == "bf16":
        return 2 * params
    if fmt == "Q4_0":
        return params // 32 * 18
    return experts // 32 * 17 + 2 * (params - experts)  # MXFP4 experts + bf16


def entry(hub_id: str, cfg: dict, fmt: str) -> dict:
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    params, experts = config_params(cfg, head_dim)
    out = {"name": f"{hub_id.split('/')[1]} ({fmt})", "hf_id": hub_id, "architecture": ARCH[cfg["architectures"][0]],
           "n_layers": cfg["num_hidden_layers"], "n_heads": n_heads, "n_kv_heads": cfg["num_key_value_heads"],
           "head_dim": head_dim, "hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"],
           "vocab_size": cfg["vocab_size"], "context_length": cfg["max_position_embeddings"],
           "rope_base": cfg["rope_theta"], "n_params": params, "weight_bytes": weight_bytes(fmt, params, experts),
           "weights": fmt, "source": f"config.json of {hub_id}"}
    if cfg.get("sliding_window"):
        out["sliding_window"] = cfg["sliding_window"]
    if cfg.get("sliding_window_pattern"):
        out["swa_pattern"] = cfg["sliding_window_pattern"]
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if n_experts:
        out["moe"] = {"n_experts": n_experts, "n_active": cfg.get("num_experts_per_tok") or cfg["experts_per_token"],
                      "expert_params": experts}
    return out


def main() -> None:
    path = ROOT / "assets" / "models.json"
    data = json.loads(path.read_text())
    for key, (hub_id, cfg, fmt) in CONFIGS.items():
        data["models"][key] = entry(hub_id, cfg, fmt)
    lines = ["{", f'  "_about": {json.dumps(data["_about"])},', '  "models": {']
    items = list(data["models"].items())
    for i, (key, value) in enumerate(items):
        lines.append(f"    {json.dumps(key)}: {json.dumps(value)}" + ("," if i < len(items) - 1 else ""))
    lines += ["  }", "}"]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    main()
