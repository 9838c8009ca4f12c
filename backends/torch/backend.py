"""TorchBackend: localctx's own Llama-family model in torch with a paged KV cache (CUDA fp16/bf16;
CPU fp32/bf16 for tests and small models). This module imports no torch, so the planner can ask
its capabilities on a machine without torch; loading lives in loading.py."""
from __future__ import annotations

import importlib.util
import os

from localctx.backends.base import Backend, Capabilities
from localctx.backends.models.spec_reader import NATIVE_GRAPH, require_safetensors
from localctx.backends.models.ref import ModelRef
from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import HardwareProfile
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.plan import Plan


# every name loading.DTYPES takes, with its element size (this module imports no torch; a test ties the two)
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


class TorchBackend(Backend):
    name = "torch"
    kv_cell_tokens = 16  # the paged cache's block (kvcache/paged.py DEFAULT_BLOCK_SIZE; the planner imports no torch)

    def __init__(self, options: TorchOptions | None = None):
        self._options = options

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed: pip install 'localctx[torch]' (CPU build first on Linux: pip install torch==2.13.0)"
        return None

    def options(self) -> TorchOptions:
        from localctx.backends.torch.loading import TorchOptions

        return self._options or TorchOptions.from_env()

    def calibration_name(self) -> str:
        """``torch-<device>-<dtype>-<weights>[-<threads>t]``: a calibration holds for one setting only."""
        if self.unavailable_reason():
            return self.name
        return f"{self.name}-{self.options().speed_key()}"

    def kv_elem_bytes(self, spec: ModelSpec, hw: HardwareProfile) -> int:
        """The cache holds the dtype the model computes in (loading.TorchOptions): LOCALCTX_TORCH_DTYPE on this
        machine where set, else bf16 on a CUDA GPU and float32 on a CPU."""
        name = os.environ.get("LOCALCTX_TORCH_DTYPE") if hw.detected else None
        if name in DTYPE_BYTES:
            return DTYPE_BYTES[name]
        return 2 if hw.kind == "cuda" else 4

    def capabilities(self) -> Capabilities:
        return Capabilities(kv_bits=frozenset({16, 8, 4}), split_kv=True, residual=True, sinks_window=True, heavy=True, batch=True,
                            native_graphs=NATIVE_GRAPH,
                            notes=("full-precision paged KV, or the policy cache (quantized, sinks + window, "
                                   "heavy hitters); the model's own graph in torch",))

    def load(self, model: ModelRef, plan: Plan) -> TorchSession:
        from localctx.backends.torch.loading import build_session, load_model

        if model.kind == "hf":
            require_safetensors(model.path)
        refusals = self.refusals(plan.policy)
        if refusals:
            raise UserError(f"the torch backend cannot run KV policy {plan.policy}: {'; '.join(refusals)}")
        options = self.options()
        return build_session(load_model(model, options), plan, options)
