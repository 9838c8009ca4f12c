"""MLXBackend: Apple Silicon (and Linux CPU for tests). This module imports no mlx, so the
planner can ask its capabilities on any machine; the session lives in session.py. A model runs on
mlx-lm's model for its architecture (zoo.py) or on localctx's own page (loading.py: the Llama family
and Gemma 3) where the policy needs the page (``zoo.graph_for``)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json

from localctx.backends.base import Backend, Capabilities
from localctx.backends.mlx import zoo
from localctx.backends.models.spec_reader import NATIVE_GRAPH, read_spec, require_safetensors
from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import HardwareProfile
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec


class MLXBackend(Backend):
    name = "mlx"
    kv_reserved_at_load = False  # the caches' buffers grow as tokens arrive (full_rows.py, mlx-lm's own caches)

    def __init__(self, options=None):
        self._options = options  # a session.SessionOptions; None = the defaults

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("mlx") is None:
            return "mlx is not installed: pip install 'localctx[mlx]' (on Linux: pip install 'mlx[cpu]')"
        return None

    def capabilities(self) -> Capabilities:
        kernels = ("Metal kernels (fused quantized decode attention, quantise-and-append) where Metal exists; "
                   "the pure-MLX reference kernels elsewhere")
        return Capabilities(kv_bits=frozenset({16, 8, 4}), group_sizes=frozenset({32, 64}), residual=True,
                            sinks_window=True, heavy=True, batch=False,
                            native_graphs=NATIVE_GRAPH | zoo.architectures(),
                            notes=(kernels, "one sequence at a time: generate_batch runs prompts in turn",
                                   "every architecture mlx-lm implements, on mlx-lm's model with localctx's "
                                   "policy cache (keys rotated at stream positions; no heavy hitters)",
                                   "the Llama family and Gemma 3 also on localctx's own pages: keys cached "
                                   "before RoPE, rotated at their in-cache positions, heavy hitters"))

    def kv_elem_bytes(self, spec: ModelSpec, hw: HardwareProfile) -> int:
        """The caches hold the dtype the model computes in (loading.compute_dtype): float16 on Apple silicon,
        float32 on a CPU, as mlx-lm's own KVCache does."""
        return 2 if hw.kind == "apple" else 4

    def check_model(self, spec: ModelSpec) -> None:
        if spec.architecture not in NATIVE_GRAPH and not zoo.supports(spec.architecture):
            raise UserError(f"--backend mlx runs the architectures mlx-lm implements and {', '.join(sorted(NATIVE_GRAPH))}, "
                            f"not {spec.architecture!r}; run it with --backend llamacpp and a GGUF file")

    def refusals(self, policy: KVPolicy, spec: ModelSpec | None = None) -> list[str]:
        out = self.capabilities().refusals(policy)
        if spec is not None and spec.architecture not in NATIVE_GRAPH:
            out += zoo.refusals(policy, spec)
        if spec is not None and policy.quantized and spec.head_dim % policy.group_size:
            fix = "use g32 or fp16" if spec.head_dim % 32 == 0 else "use fp16"
            out.append(f"head dim {spec.head_dim} is not a multiple of the group size {policy.group_size}; {fix}")
        return out

    def load(self, model, plan: Plan):
        from localctx.backends.mlx.loading import load_folder, load_gguf
        from localctx.backends.mlx.session import MLXSession, SessionOptions
        from localctx.backends.mlx.tokenizer import folder_tokenizer, gguf_tokenizer

        options = self._options or SessionOptions()
        if model.kind not in ("gguf", "hf"):
            raise UserError(f"--backend mlx runs GGUF files and safetensors folders, not {model.kind!r} models")
        if model.kind == "hf":
            require_safetensors(model.path)
        spec = held_in_compute_dtype(read_spec(model))
        self.check_model(spec)
        refusals = self.refusals(plan.policy, spec)
        if refusals:
            raise UserError(f"backend mlx cannot run KV policy {plan.policy}: {'; '.join(refusals)}")
        graph = zoo.graph_for(spec, plan.policy, options.graph)
        if graph == "mlx-lm":
            refused = zoo.refusals(plan.policy, spec)
            if refused:
                raise UserError(f"backend mlx cannot run KV policy {plan.policy} on mlx-lm's model: {'; '.join(refused)}")
        if model.kind == "gguf":
            from localctx.backends.models.spec_reader import read_gguf

            loaded = zoo.load_gguf(model.path, spec.architecture, options.load) if graph == "mlx-lm" else load_gguf(model.path, options.load)[0]
            tokenizer = gguf_tokenizer(model.path, read_gguf(model.path))
        else:
            loaded = zoo.load_folder(model.path, spec.architecture, options.load) if graph == "mlx-lm" else load_folder(model.path, options.load)[0]
            tokenizer = folder_tokenizer(model.path, json.loads((model.path / "config.json").read_text()))
        return MLXSession(loaded, tokenizer, spec, plan, options)


def held_in_compute_dtype(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the KV element the caches hold on this machine: the dtype the model computes in."""
    from localctx.backends.mlx.loading import compute_dtype

    return dataclasses.replace(spec, kv_elem_bytes=compute_dtype().size)
