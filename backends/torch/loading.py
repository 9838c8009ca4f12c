"""Loading for the torch backend: a GGUF or an HF folder into localctx's own Llama-family model with a paged
KV cache. Runs on CUDA (fp16/bf16) and on CPU (fp32/bf16; CPU is for tests and small models).

Settings beyond the plan come from the environment (the registry builds backends without
arguments): LOCALCTX_TORCH_DEVICE (cuda | cpu), LOCALCTX_TORCH_DTYPE (fp32 | bf16 | fp16),
LOCALCTX_TORCH_WEIGHTS (dense | int8; int8 = weight-only int8 on CPU), LOCALCTX_TORCH_THREADS (CPU
threads; on a shared, busy CPU one thread can be much faster than two that wait on each other)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from localctx.backends.models.spec_reader import read_config_json, read_gguf
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch import gemma3
from localctx.backends.torch import llama
from localctx.backends.torch.config import BuildOptions
from localctx.backends.torch.cpu_kernels import policy_attention as cpu_attention
from localctx.backends.torch.engine import Engine, EngineOptions
from localctx.backends.torch.linear import WEIGHT_FORMATS
from localctx.backends.torch.session import TorchSession
from localctx.backends.torch.tokenizer import TextTokenizer, from_gguf, from_hf_folder
from localctx.kernels_cuda import dispatch
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError
from localctx.kvcache.factory import CacheKernels, CacheRequest, make_kv_cache
from localctx.kvcache.paged import DEFAULT_BLOCK_SIZE
from localctx.kvcache.plan import Plan
from localctx.kvcache.model_spec import ModelSpec

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
ALLOWED = {"cpu": {torch.float32, torch.bfloat16}, "cuda": {torch.float16, torch.bfloat16}}
# the page that builds each architecture (a GGUF's general.architecture, a config.json's model_type);
# each page has from_gguf(reader, path, name, build) and from_hf(folder, name, build)
MODEL_PAGES = {"llama": llama, "mistral": llama, "qwen2": llama, "qwen3": llama,
               "gemma3": gemma3, "gemma3_text": gemma3}
_HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text"}


def hf_architecture(cfg: dict) -> str | None:
    """The page key of a config.json: its model class where we know it, else its model_type."""
    known = [_HF_CLASSES[a] for a in cfg.get("architectures") or [] if a in _HF_CLASSES]
    return known[0] if known else cfg.get("model_type")


@dataclass(frozen=True)
class TorchOptions:
    device: str
    dtype: torch.dtype
    weights: str = "dense"
    block_size: int = DEFAULT_BLOCK_SIZE
    pool_tokens: int | None = None  # KV pool size; default: the plan's context
    prefill_chunk: int = EngineOptions.prefill_chunk
    threads: int | None = None  # CPU threads for torch (process-wide); None = torch's default

    @classmethod
    def from_env(cls, **overrides) -> "TorchOptions":
        device = os.environ.get("LOCALCTX_TORCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ALLOWED:
            raise UserError(f"LOCALCTX_TORCH_DEVICE={device!r}: choose cuda or cpu")
        name = os.environ.get("LOCALCTX_TORCH_DTYPE") or ("bf16" if device == "cuda" else "fp32")
        if name not in DTYPES:
            raise UserError(f"LOCALCTX_TORCH_DTYPE={name!r}: choose fp32, bf16 or fp16")
        weights = os.environ.get("LOCALCTX_TORCH_WEIGHTS", "dense")
        if weights not in WEIGHT_FORMATS:
            raise UserError(f"LOCALCTX_TORCH_WEIGHTS={weights!r}: choose {' or '.join(WEIGHT_FORMATS)}")
        threads = os.environ.get("LOCALCTX_TORCH_THREADS")
        if threads is not None and not (threads.isdigit() and int(threads) > 0):
            raise UserError(f"LOCALCTX_TORCH_THREADS={threads!r}: give a positive number of threads")
        opts = cls(device=device, dtype=DTYPES[name], weights=weights, threads=int(threads) if threads else None)
        return dataclasses.replace(opts, **overrides).checked()

    def speed_settings(self) -> dict:
        """The settings a decode step's speed depends on (a calibration holds for these only)."""
        out = {"device": self.device, "dtype": str(self.dtype).replace("torch.", ""), "weights": self.weights}
        if self.device == "cpu":
            out["threads"] = self.threads or torch.get_num_threads()
            out["kv_kernel"] = "c" if cpu_attention.available() else "torch"
        return out

    def speed_key(self) -> str:
        """``speed_settings`` as a file-name part, e.g. ``cpu-bfloat16-int8-2t``."""
        s = self.speed_settings()
        parts = [s["device"], s["dtype"], s["weights"]] + ([f"{s['threads']}t"] if "threads" in s else [])
        if s.get("kv_kernel") == "torch":  # no C compiler: quantized and windowed KV take the slower reference
            parts.append("torchkv")
        return "-".join(parts)

    def checked(self) -> "TorchOptions":
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("the torch backend was asked for CUDA but torch sees no GPU; set LOCALCTX_TORCH_DEVICE=cpu")
        if self.dtype not in ALLOWED[self.device]:
            allowed = ", ".join(sorted(str(d).replace("torch.", "") for d in ALLOWED[self.device]))
            raise UserError(f"the torch backend runs {allowed} on {self.device}, not {self.dtype}")
        return self


@dataclass
class LoadedModel:
    model: llama.LlamaModel | gemma3.Gemma3Model
    tokenizer: TextTokenizer
    spec: ModelSpec


def model_page(architecture: str | None, source: str):
    page = MODEL_PAGES.get(str(architecture))
    if page is None:
        raise UserError(f"unsupported architecture {architecture!r} in {source}; the torch backend runs "
                        f"{', '.join(sorted(MODEL_PAGES))} (use --backend llamacpp for the others)")
    return page


def load_model(ref: ModelRef, options: TorchOptions) -> LoadedModel:
    if options.threads:
        torch.set_num_threads(options.threads)
    # int8 weights are quantized from float32; dense ones are converted to their dtype as they load
    build = BuildOptions(load_dtype=torch.float32 if options.weights == "int8" else options.dtype,
                         dtype=options.dtype, device=options.device, weights=options.weights)
    if ref.kind == "gguf":
        reader = read_gguf(ref.path)
        page = model_page(reader.get("general.architecture"), ref.path.name)
        model, spec = page.from_gguf(reader, ref.path, ref.name, build)
        tokenizer = from_gguf(reader, ref.path.name)
    elif ref.kind == "hf":
        page = model_page(hf_architecture(read_config_json(ref.path)), str(ref.path))
        model, spec = page.from_hf(ref.path, ref.name, build)
        tokenizer = from_hf_folder(ref.path)
    else:
        raise UserError(f"the torch backend loads GGUF files and HF folders, not {ref.kind!r} models")
    return LoadedModel(model, tokenizer, spec)


def _policy_attention(device: str):
    """The C kernel on a CPU where it builds; the Triton kernel or the reference otherwise."""
    if device == "cpu" and not dispatch.uses_kernels(device) and cpu_attention.available():
        return cpu_attention.attend
    return dispatch.policy_attention(device)


def make_cache(model, policy, tokens: int, options: TorchOptions):
    """The KV cache ``policy`` needs with room for ``tokens`` (a windowed one: its capacity, plus a group
    and a chunk), with the kernels this device has."""
    if policy.capacity() is not None:  # a windowed cache holds up to its capacity, plus a group and a chunk
        tokens = max(tokens, policy.capacity() + policy.group_size + options.prefill_chunk)
    c = model.config
    req = CacheRequest(c.n_layers, c.n_kv_heads, c.head_dim, capacity_tokens=tokens, dtype=options.dtype,
                       device=options.device, block_size=options.block_size, layer_windows=model.layer_windows())
    kernels = CacheKernels(paged_attention=dispatch.paged_attention(options.device),
                           policy_attention=_policy_attention(options.device),
                           quantize_groups=dispatch.quantize_groups(options.device)
                           if dispatch.uses_kernels(options.device) else None)
    return make_kv_cache(policy, req, model.make_rope(), kernels)  # paged full precision, or the policy cache


def build_session(loaded: LoadedModel, plan: Plan, options: TorchOptions) -> TorchSession:
    """A session with the plan's allocation (``options.pool_tokens`` where set); a session whose plan
    allocates less than its context grows its cache up to it (TorchSession.fit)."""
    model, policy = loaded.model, plan.policy
    cache = make_cache(model, policy, options.pool_tokens or plan.allocated_context, options)
    engine = Engine(model, cache, EngineOptions(prefill_chunk=options.prefill_chunk))
    elem_bytes = torch.empty((), dtype=options.dtype).element_size()
    spec = dataclasses.replace(loaded.spec, kv_elem_bytes=elem_bytes, weight_bytes=model.weight_bytes())
    session = TorchSession(engine, loaded.tokenizer, spec, plan, options)
    if options.pool_tokens is None and not policy.evicts:
        session.resize = lambda tokens: make_cache(model, policy, tokens, options)
        if plan.allocated_context < plan.context:  # sized with the file's element size; held in ``options.dtype``
            plan.grow_to(plan.allocated_context, cost.max_kv_bytes(spec, policy, plan.allocated_context))
    return session
