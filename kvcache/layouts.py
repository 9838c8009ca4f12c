"""Per-layer attention layouts: which layers slide and which attend to everything.

Where llama.cpp fixes the sliding pattern by architecture, it is encoded once here, in
``SWA_PATTERNS``. Source: llama.cpp ``src/models/<arch>.cpp`` (``load_swa_pattern(ml, n)``) and
``src/llama-hparams.cpp`` (``set_swa_pattern``): with pattern ``n``, layer ``il`` slides when
``il % n < n - 1`` (the last layer of every ``n`` is global), or, "dense first", when ``il % n != 0``
(the first of every ``n`` is global). A GGUF may override the pattern with
``{arch}.attention.sliding_window_pattern`` (one bool per layer, or the period ``n``); llama.cpp
reads that first, and so do we.

Recurrent architectures hold no KV in any layer (llama.cpp's ``llm_arch_is_recurrent``)."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.kvcache.model_spec import FULL, NONE, SLIDING, LayerAttention


@dataclass(frozen=True)
class SwaPattern:
    period: int  # 0: every layer slides
    dense_first: bool = False
    default_window: int | None = None  # what llama.cpp assumes when the GGUF names none (else: no sliding)


# architecture → its fixed pattern, from llama.cpp src/models/<arch>.cpp (load_arch_hparams)
SWA_PATTERNS: dict[str, SwaPattern] = {
    "gemma2": SwaPattern(2, default_window=4096),  # gemma2.cpp: n_swa = 4096 unless the GGUF says
    "gemma3": SwaPattern(6),  # gemma3.cpp: sliding only when sliding_window > 0 (5 local : 1 global)
    "gemma-embedding": SwaPattern(6),
    "gemma3n": SwaPattern(5),
    "gpt-oss": SwaPattern(2),  # openai-moe.cpp: alternating windows (128 in the published model)
    "cohere2": SwaPattern(4),
    "cohere2moe": SwaPattern(4, dense_first=True),
    "exaone4": SwaPattern(4),
    "olmo2": SwaPattern(4),
    "mellum": SwaPattern(4),
    "afmoe": SwaPattern(4),
    "smallthinker": SwaPattern(4, dense_first=True),
    "plamo3": SwaPattern(8),
    "muse-glimmer": SwaPattern(4),
}

# llama.cpp's llm_arch_is_recurrent (src/llama-arch.cpp): no KV cache in any layer
RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

# architectures whose attention is not plain per-head K and V, or not causal text generation;
# their KV is estimated as full attention and the plan says so
UNMODELLED = {
    "deepseek2": "MLA caches a compressed latent, not per-head K and V",
    "llama4": "chunked attention (8,192-token chunks) on 3 of 4 layers",
}


def swa_flags(n_layers: int, pattern: SwaPattern) -> list[bool]:
    """llama_hparams::set_swa_pattern: True where layer ``il`` slides."""
    n = pattern.period
    if n == 0:
        return [True] * n_layers
    if pattern.dense_first:
        return [il % n != 0 for il in range(n_layers)]
    return [il % n < n - 1 for il in range(n_layers)]


def build_layers(n_layers: int, kv_heads: list[int], k_dim: int, v_dim: int, sliding: list[bool],
                 window: int | None, k_dim_swa: int | None = None, v_dim_swa: int | None = None,
                 no_kv: list[bool] | None = None) -> tuple[LayerAttention, ...]:
    """Layer descriptions from per-layer facts (``kv_heads[i] == 0`` or ``no_kv[i]``: no KV there)."""
    out = []
    for il in range(n_layers):
        if (no_kv and no_kv[il]) or kv_heads[il] == 0:
            out.append(LayerAttention(NONE))
        elif sliding[il] and window:
            out.append(LayerAttention(SLIDING, kv_heads[il], k_dim_swa or k_dim, v_dim_swa or v_dim, window))
        else:
            out.append(LayerAttention(FULL, kv_heads[il], k_dim, v_dim))
    return tuple(out)


def pattern_for(arch: str, n_layers: int, window: int | None,
                pattern_key: list[bool] | int | None = None) -> tuple[list[bool], int | None]:
    """(which layers slide, the window) for ``arch`` as llama.cpp decides them."""
    if isinstance(pattern_key, list) and len(pattern_key) == n_layers and window:
        return [bool(x) for x in pattern_key], window
    fixed = SWA_PATTERNS.get(arch)
    if fixed is None:
        return [False] * n_layers, None
    window = window or fixed.default_window
    if not window:
        return [False] * n_layers, None
    period = pattern_key if isinstance(pattern_key, int) else fixed.period
    return swa_flags(n_layers, SwaPattern(period, fixed.dense_first)), window


def config_params(cfg: dict, head_dim: int) -> tuple[int, int]:
    """(all parameters, routed-expert parameters) from config.json shapes: embeddings, attention
    projections, the MLP or the experts (plus shared experts), and an untied output head."""
    hidden, vocab, n_layers = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    attn = hidden * head_dim * (2 * n_heads + 2 * n_kv)
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    experts = 0
    if n_experts:
        moe_ff = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size"))
        experts = n_layers * n_experts * 3 * hidden * moe_ff
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        mlp = 3 * hidden * shared + hidden * n_experts
    else:
        mlp = 3 * hidden * int(cfg.get("intermediate_size", 4 * hidden))
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return embed + n_layers * (attn + mlp) + experts, experts
