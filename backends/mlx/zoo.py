"""mlx-lm as the MLX backend's model zoo: every architecture mlx-lm implements, from an mlx-community
folder (already-quantized safetensors), a Hugging Face safetensors folder (both through
``mlx_lm.utils.load_model``) or a GGUF (gguf_convert.py makes the folder once). ``supports`` and
``refusals`` read no weights and import no mlx, so the planner asks them on any machine.

Where localctx's own pages (llama.py, gemma3.py) run a model instead: ``graph_for``."""
from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from localctx.kvcache.model_spec import SLIDING, ModelSpec
from localctx.kvcache.policy import KVPolicy

# localctx's architecture names (backends/models/spec_reader.py) → mlx-lm's model files
_MODULE = {"mistral": "llama", "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
           "gpt-oss": "gpt_oss", "command-r": "cohere", "phi2": "phi"}
# architectures mlx-lm runs on caches of its own (model.make_cache: sliding or recurrent layers)
_OWN_CACHES = {"gemma2", "gemma3", "gemma3n", "cohere2", "gpt-oss", "mistral3", "smollm3"}


def module_name(architecture: str) -> str:
    return _MODULE.get(architecture, architecture.replace("-", "_"))


_NOT_MODELS = {"__init__", "base", "cache", "rope_utils", "switch_layers", "activations", "gated_delta", "ssm",
               "mla", "pipeline", "bitlinear_layers"}


@functools.cache
def architectures() -> frozenset[str]:
    """localctx's names of the architectures the installed mlx-lm implements (read off its model
    files, without importing mlx); empty without mlx-lm."""
    found = importlib.util.find_spec("mlx_lm")
    if found is None or not found.submodule_search_locations:
        return frozenset()
    files = {p.stem for loc in found.submodule_search_locations for p in (Path(loc) / "models").glob("*.py")}
    files -= _NOT_MODELS
    return frozenset(files | {arch for arch, module in _MODULE.items() if module in files})


def supports(architecture: str) -> bool:
    return architecture in architectures()


def own_caches(spec: ModelSpec) -> bool:
    return spec.architecture in _OWN_CACHES or any(layer.kind == SLIDING for layer in spec.attention())


def refusals(policy: KVPolicy, spec: ModelSpec) -> list[str]:
    """Why an mlx-lm model of ``spec`` cannot run ``policy`` (lm_cache.py says how policies plug in)."""
    arch = spec.architecture
    if own_caches(spec) and (policy.quantized or policy.evicts):
        return [f"mlx-lm's {arch} keeps caches of its own (sliding-window or recurrent layers), which take "
                "full-precision KV only; use fp16"]
    out = []
    if policy.heavy:
        out.append(f"heavy hitters need attention weights, which mlx-lm's {arch} attention does not return; "
                   "use sinks + window without heavy hitters")
    return out


def graph_for(spec: ModelSpec, policy: KVPolicy, forced: str) -> str:
    """"page" (localctx's own graph: keys cached before RoPE, re-indexed past a window; heavy hitters;
    the Metal decode kernel) or "mlx-lm". ``forced``: "auto", "page" or "mlx-lm". Auto takes the page
    where the architecture has one and the policy is one mlx-lm's models cannot take or the window
    must stream past the trained context; mlx-lm everywhere else."""
    from localctx.backends.mlx.loading import MODEL_PAGES

    has_page = spec.architecture in MODEL_PAGES
    if forced != "auto":
        return forced
    if has_page and (refusals(policy, spec) or policy.evicts):
        return "page"
    return "mlx-lm" if supports(spec.architecture) else "page"


# -- loading (imports mlx) ------------------------------------------------------------------------
@dataclass
class LMModel:
    """An mlx-lm model as the session calls a graph: ``model(tokens, cache, last_only)``."""
    model: object  # mlx_lm.models.<type>.Model
    config: dict

    def __call__(self, tokens, cache, last_only: bool = True):
        import mlx.core as mx

        logits = self.model(tokens[None], cache=cache.layers)
        cache.stepped(tokens.shape[0])
        logits = logits[0, -1:] if last_only else logits[0]
        return logits.astype(mx.float32)[0] if last_only else logits.astype(mx.float32)

    def make_cache(self, policy: KVPolicy, spec: ModelSpec):
        import mlx.core as mx

        from localctx.backends.mlx.lm_cache import LMCache, NativeCache
        from localctx.backends.mlx.policy_cache import CacheShape

        from mlx_lm.models.cache import KVCache, make_prompt_cache

        from localctx.kvcache.errors import UserError

        if not all(type(c) is KVCache for c in make_prompt_cache(self.model)):  # sliding or recurrent layers
            if policy.quantized or policy.evicts:
                raise UserError(f"mlx-lm's {spec.architecture} keeps caches of its own (sliding-window or "
                                "recurrent layers), which take full-precision KV only; use --kv fp16")
            return NativeCache(self.model, spec.context_length)
        n_kv = int(self.config.get("num_key_value_heads") or self.config["num_attention_heads"])
        head_dim = int(self.config.get("head_dim") or self.config["hidden_size"] // self.config["num_attention_heads"])
        shape = CacheShape(n_kv, head_dim, mx.float16 if spec.kv_elem_bytes == 2 else mx.float32, False)
        return LMCache(policy, len(self.model.layers), shape, spec.context_length)


def load_folder(folder: Path, architecture: str | None = None, options=None) -> LMModel:
    """``architecture``: localctx's name for it, which names mlx-lm's model file where config.json
    has no ``model_type``. ``options``: loading.LoadOptions; where it wants the weights expanded (by
    default off Metal, where MLX's quantized matmul is a scalar loop) the quantized layers are
    dequantized (the same values) and the model computes in loading.compute_dtype()."""
    from mlx_lm.utils import load_model

    from localctx.kvcache.errors import UserError

    cfg = json.loads((Path(folder) / "config.json").read_text())
    extra = {}
    if "model_type" not in cfg and architecture is not None:
        extra["model_type"] = module_name(architecture)
    if "tie_word_embeddings" not in cfg:  # Hugging Face's default is untied where an lm_head is stored
        extra["tie_word_embeddings"] = not any("lm_head.weight" in _tensor_names(f) for f in Path(folder).glob("*.safetensors"))
    try:
        model, config = load_model(Path(folder), model_config=extra or None)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(f"mlx-lm cannot load {folder.name} ({str(exc).splitlines()[0][:160]}); "
                        "use --backend llamacpp with a GGUF of it") from None
    from localctx.backends.mlx.loading import LoadOptions, compute_dtype

    if (options or LoadOptions()).wants_dequantize():
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        model.set_dtype(compute_dtype())
        _evaluate(model)
    return LMModel(model, config)


def _evaluate(model) -> None:
    import mlx.core as mx

    mx.eval(model.parameters())


def _tensor_names(file: Path) -> set[str]:
    """The tensor names in a safetensors file's header (8-byte length, then JSON)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return set(json.loads(f.read(size))) - {"__metadata__"}


def load_gguf(path: Path, architecture: str | None = None, options=None) -> LMModel:
    from localctx.backends.mlx.gguf_convert import converted_folder

    return load_folder(converted_folder(path), architecture, options)
