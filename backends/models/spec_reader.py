"""Read a ModelSpec from GGUF metadata or config.json without loading weights."""
from __future__ import annotations

import json
from pathlib import Path

from localctx.backends.models.gguf_meta import ModelMeta
from localctx.backends.models.ref import ModelRef, hub_cache_dir, hub_offline
from localctx.kvcache.errors import UserError
from localctx.kvcache.layouts import RECURRENT, SWA_PATTERNS, UNMODELLED, build_layers, config_params, pattern_for
from localctx.kvcache.model_spec import MoE, ModelSpec

# the Llama family's graph (GQA attention + RoPE + SwiGLU MLP + RMSNorm), which the torch and MLX
# engines implement; llama.cpp runs any architecture it loads
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3"}
# the architectures whose page the torch and MLX engines have (their Capabilities.native_graphs);
# (backends/torch/gemma3.py, backends/mlx/gemma3.py)
NATIVE_GRAPH = frozenset(LLAMA_FAMILY | {"gemma3"})

# architectures whose attention the readers know layer by layer (every other one is read as full
# attention on every layer, and the spec records that as an assumption)
KNOWN_LAYOUT = (LLAMA_FAMILY | set(SWA_PATTERNS) | RECURRENT | {
    "mistral3", "qwen2moe", "qwen3moe", "phi2", "phi3", "phimoe", "gemma", "granite", "granitemoe", "olmo",
    "olmoe", "starcoder2", "stablelm", "internlm2", "deepseek", "command-r", "exaone", "smollm3", "glm4",
    "glm4moe", "ernie4_5", "ernie4_5-moe", "falcon", "gpt2", "baichuan", "minicpm", "arcee", "apertus",
    "hunyuan-dense", "seed_oss", "granitehybrid", "jamba", "lfm2", "lfm2moe", "qwen3next", "nemotron_h"})

_HF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
            "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
            "Gemma3ForConditionalGeneration": "gemma3", "GptOssForCausalLM": "gpt-oss",
            "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3",
            "Mistral3ForConditionalGeneration": "mistral3", "Cohere2ForCausalLM": "cohere2"}


def read_spec(ref: ModelRef) -> ModelSpec:
    if ref.kind == "gguf":
        return gguf_spec(ref.path, ref.name)
    if ref.kind == "hf":
        return hf_spec(ref.path, ref.name)
    raise UserError(f"no spec reader for model kind {ref.kind!r}")


def read_gguf(path: Path):
    """``path``'s GGUF header (metadata + tensor infos, no tensor data), parsed at most once per file
    and cached by size + mtime (backends/models/gguf_header_cache.py); a truncated or corrupt file is a UserError."""
    from localctx.backends.models.gguf_header_cache import cached_header

    return cached_header(path)


def _per_layer(value, n_layers: int, default: int) -> list[int]:
    """A GGUF value that is one number for every layer or an array with one per layer."""
    if value is None:
        return [default] * n_layers
    if isinstance(value, (list, tuple)):
        values = [int(v) for v in value]
        if len(values) != n_layers:
            raise UserError(f"a per-layer array has {len(values)} entries for {n_layers} layers; the file is damaged")
        return values
    return [int(value)] * n_layers


def _expert_tensors(reader) -> tuple[int, int]:
    """(bytes, parameters) of the routed experts' tensors (``blk.N.ffn_*_exps``; shared experts are dense)."""
    experts = [t for t in reader.tensors if "_exps." in t.name]
    return sum(int(t.n_bytes) for t in experts), sum(int(t.n_elements) for t in experts)


def gguf_spec(path: Path, name: str | None = None) -> ModelSpec:
    reader = read_gguf(path)
    meta = ModelMeta(reader, path.name)
    arch = meta.arch
    if not arch:
        raise UserError(f"{path} has no general.architecture in its metadata; it is not a model GGUF")
    n_layers = int(meta.need("block_count"))
    hidden = int(meta.need("embedding_length"))
    heads = _per_layer(meta.get("attention.head_count"), n_layers, 0)
    n_heads = max(heads)
    kv_count = meta.get("attention.head_count_kv")
    kv_heads = _per_layer(kv_count, n_layers, 0) if kv_count is not None else list(heads)
    k_dim = int(meta.get("attention.key_length", hidden // n_heads if n_heads else 0))
    v_dim = int(meta.get("attention.value_length", hidden // n_heads if n_heads else 0))
    window = meta.get("attention.sliding_window")
    sliding, window = pattern_for(arch, n_layers, int(window) if window else None,
                                  meta.get("attention.sliding_window_pattern"))
    no_kv = _no_kv_layers(arch, n_layers, meta.get("attention.recurrent_layers"),
                          meta.get("full_attention_interval"))
    layers = build_layers(n_layers, kv_heads, k_dim, v_dim, sliding, window,
                          k_dim_swa=meta.get("attention.key_length_swa"),
                          v_dim_swa=meta.get("attention.value_length_swa"), no_kv=no_kv)
    vocab = meta.vocab_size()
    weight_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    moe = None
    n_experts = int(meta.get("expert_count", 0) or 0)
    if n_experts:
        used = _per_layer(meta.get("expert_used_count"), n_layers, 0)
        expert_bytes, expert_params = _expert_tensors(reader)
        moe = MoE(n_experts=n_experts, n_active=max(used), expert_bytes=expert_bytes, expert_params=expert_params)
    return ModelSpec(
        name=name or str(reader.get("general.name", path.stem)), architecture=arch,
        n_layers=n_layers, n_heads=n_heads, n_kv_heads=max(kv_heads), head_dim=k_dim,
        hidden_size=hidden, vocab_size=vocab, context_length=int(meta.need("context_length")),
        rope_base=float(meta.get("rope.freq_base", 10000.0)),
        weight_bytes=weight_bytes, n_params=n_params, kv_elem_bytes=2,
        intermediate_size=max(_per_layer(meta.get("feed_forward_length"), n_layers, 0)),
        layers=layers, moe=moe, assumptions=_assumptions(arch))


def _no_kv_layers(arch: str, n_layers: int, recurrent_layers, interval) -> list[bool] | None:
    """Layers that hold no KV: every layer of a recurrent architecture; the recurrent layers of a
    hybrid one (``attention.recurrent_layers``, or all but every ``full_attention_interval``-th, as
    llama.cpp's qwen3next.cpp reads them; hybrids that mark them with head_count_kv 0 need nothing here)."""
    if arch in RECURRENT:
        return [True] * n_layers
    if isinstance(recurrent_layers, list) and len(recurrent_layers) == n_layers:
        return [bool(x) for x in recurrent_layers]
    if interval:
        return [(il + 1) % int(interval) != 0 for il in range(n_layers)]
    return None


def _assumptions(arch: str) -> tuple[str, ...]:
    if arch in UNMODELLED:
        return (f"{arch}: {UNMODELLED[arch]}; its KV is estimated as full attention on every layer",)
    if arch not in KNOWN_LAYOUT:
        return (f"architecture {arch!r} is not known to localctx's reader: full attention on every layer is "
                "assumed (llama.cpp runs it as its own code decides)",)
    return ()


def read_config_json(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{folder}/config.json cannot be read ({exc}); fix or replace it") from None


def load_hf_config(folder: Path) -> tuple[dict, str]:
    """config.json and the localctx architecture name it maps to; one-line errors otherwise."""
    cfg = read_config_json(folder)
    archs = cfg.get("architectures") or []
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    arch = next((_HF_ARCH[a] for a in archs if a in _HF_ARCH), None)
    if arch is None:
        raise UserError(f"unsupported architecture {archs or cfg.get('model_type')} in {folder}; localctx reads "
                        f"{', '.join(sorted(_HF_ARCH))} configs (any GGUF runs on --backend llamacpp)")
    return cfg, arch


def hub_config_spec(repo: str) -> ModelSpec:
    """The spec of a hub repo from its config.json alone (fetched into the hub cache when online)."""
    if hub_offline():
        raise UserError(f"{repo} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; planning it "
                        "needs its config.json: unset HF_HUB_OFFLINE, or give a local path or a known shape")
    try:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(repo, "config.json", cache_dir=hub_cache_dir()))
    except Exception as exc:  # network, auth, a missing repo: one line each way
        raise UserError(f"cannot fetch {repo}'s config.json ({type(exc).__name__}: {str(exc)[:80]}); check the "
                        "repo id and the network, or give a local path") from None
    return hf_spec(path.parent, repo)


def require_safetensors(folder: Path) -> None:
    """An engine loading an HF folder needs its safetensors (planning needs only config.json)."""
    if not any(folder.glob("*.safetensors")):
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = " (it has pickled weights, which localctx does not load)" if pickled else ""
        raise UserError(f"{folder} has no .safetensors weights{hint}; convert them to safetensors")


def config_layers(cfg: dict, arch: str, n_layers: int, n_kv: int, head_dim: int):
    """Per-layer attention from config.json: ``layer_types`` where given, else ``sliding_window``
    with the architecture's fixed pattern (``sliding_window_pattern`` overrides its period); a
    ``sliding_window`` with ``use_sliding_window: false`` (Qwen2) slides nowhere."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n_layers:
        sliding = [t == "sliding_attention" for t in types]
        no_kv = [t not in ("sliding_attention", "full_attention") for t in types]
        return build_layers(n_layers, [n_kv] * n_layers, head_dim, head_dim, sliding, window, no_kv=no_kv)
    period = cfg.get("sliding_window_pattern")
    sliding, window = pattern_for(arch, n_layers, int(window) if window else None,
                                  int(period) if period else None)
    return build_layers(n_layers, [n_kv] * n_layers, head_dim, head_dim, sliding, window)


def hf_spec(folder: Path, name: str | None = None) -> ModelSpec:
    """A spec from config.json; the safetensors' sizes give the weight bytes where they are present,
    else the parameter count from the config's shapes at its dtype (planning before a download)."""
    cfg, arch = load_hf_config(folder)
    n_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    n_layers = int(cfg["num_hidden_layers"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    elem = 4 if "32" in dtype else 2
    n_params, expert_params = config_params(cfg, head_dim)
    weights = sorted(folder.glob("*.safetensors"))
    assumptions = []
    if weights:
        weight_bytes = sum(p.stat().st_size for p in weights)
    else:
        weight_bytes = n_params * elem
        assumptions.append(f"no weights in {folder.name}: weight bytes are the config's {n_params:,} parameters "
                           f"at {dtype}")
    moe = None
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if n_experts:
        active = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 1)
        moe = MoE(n_experts, active, expert_bytes=weight_bytes * expert_params // max(n_params, 1),
                  expert_params=expert_params)
    return ModelSpec(
        name=name or folder.name, architecture=arch, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, hidden_size=hidden, vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        rope_base=float(cfg.get("rope_theta", 10000.0)), weight_bytes=weight_bytes,
        n_params=n_params, kv_elem_bytes=elem, intermediate_size=int(cfg.get("intermediate_size", 0)),
        layers=config_layers(cfg, arch, n_layers, n_kv, head_dim), moe=moe,
        assumptions=tuple(assumptions) + _assumptions(arch))
