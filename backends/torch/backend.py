"""TorchBackend: loads a GGUF or an HF folder into localctx's own Llama-family model with a paged
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

from localctx.backends.base import Backend, Capabilities
from localctx.backends.model_spec import hf_spec
from localctx.backends.modelref import ModelRef
from localctx.backends.torch.engine import Engine, EngineOptions
from localctx.backends.torch.gguf_loader import load_gguf, spec_from
from localctx.backends.torch.hf_loader import load_hf
from localctx.backends.torch.linear import WEIGHT_FORMATS
from localctx.backends.torch.model import LlamaModel
from localctx.backends.torch.session import TorchSession
from localctx.backends.torch.tokenizer import TextTokenizer, from_gguf, from_hf_folder
from localctx.kvcache.errors import UserError
from localctx.kvcache.paged import DEFAULT_BLOCK_SIZE, CacheShape, PagedKVCache
from localctx.kvcache.plan import Plan
from localctx.kvcache.spec import ModelSpec

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
ALLOWED = {"cpu": {torch.float32, torch.bfloat16}, "cuda": {torch.float16, torch.bfloat16}}


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

    def checked(self) -> "TorchOptions":
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("the torch backend was asked for CUDA but torch sees no GPU; set LOCALCTX_TORCH_DEVICE=cpu")
        if self.dtype not in ALLOWED[self.device]:
            allowed = ", ".join(sorted(str(d).replace("torch.", "") for d in ALLOWED[self.device]))
            raise UserError(f"the torch backend runs {allowed} on {self.device}, not {self.dtype}")
        return self


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: TextTokenizer
    spec: ModelSpec


def load_model(ref: ModelRef, options: TorchOptions) -> LoadedModel:
    if options.threads:
        torch.set_num_threads(options.threads)
    # int8 weights are quantized from float32; dense ones are converted to their dtype as they load
    load_dtype = torch.float32 if options.weights == "int8" else options.dtype
    if ref.kind == "gguf":
        config, tensors, freq_factors, reader = load_gguf(ref.path, load_dtype)
        tokenizer = from_gguf(reader, ref.path.name)
        spec = spec_from(reader, config, ref.name)
    elif ref.kind == "hf":
        config, tensors = load_hf(ref.path, load_dtype)
        freq_factors = None
        tokenizer = from_hf_folder(ref.path)
        spec = hf_spec(ref.path, ref.name)
    else:
        raise UserError(f"the torch backend loads GGUF files and HF folders, not {ref.kind!r} models")
    model = LlamaModel(config, tensors, dtype=options.dtype, device=options.device, weights=options.weights,
                       freq_factors=freq_factors)
    return LoadedModel(model, tokenizer, spec)


def build_session(loaded: LoadedModel, plan: Plan, options: TorchOptions) -> TorchSession:
    c = loaded.model.config
    shape = CacheShape.for_tokens(options.pool_tokens or plan.context, block_size=options.block_size,
                                  n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                  dtype=options.dtype, device=options.device)
    cache = PagedKVCache(shape, loaded.model.make_rope())
    engine = Engine(loaded.model, cache, EngineOptions(prefill_chunk=options.prefill_chunk))
    spec = dataclasses.replace(loaded.spec, kv_elem_bytes=shape.elem_bytes, weight_bytes=loaded.model.weight_bytes())
    return TorchSession(engine, loaded.tokenizer, spec, plan)


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, options: TorchOptions | None = None):
        self._options = options

    def options(self) -> TorchOptions:
        return self._options or TorchOptions.from_env()

    def capabilities(self) -> Capabilities:
        return Capabilities(kv_bits=frozenset({16}), batch=True,
                            notes=("full-precision paged KV; the model's own graph in torch",))

    def load(self, model: ModelRef, plan: Plan) -> TorchSession:
        refusals = self.refusals(plan.policy)
        if refusals:
            raise UserError(f"the torch backend cannot run KV policy {plan.policy}: {'; '.join(refusals)}")
        options = self.options()
        return build_session(load_model(model, options), plan, options)
