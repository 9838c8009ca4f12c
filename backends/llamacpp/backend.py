"""The llama.cpp backend on llama-cpp-python: GGUF models on CPU (or any GPU llama.cpp supports).

What it can hold and refuses, and what it allocates, without importing llama.cpp; ``load`` opens a
session (session.py)."""
from __future__ import annotations

from localctx.backends.base import Backend, Capabilities
from localctx.backends.llamacpp import shift
from localctx.backends.models.ref import ModelRef
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


class LlamaCppBackend(Backend):
    name = "llamacpp"
    kv_cell_tokens = 256  # llama.cpp pads a context to 256 cells (allocation.py)

    def unavailable_reason(self) -> str | None:
        from localctx.backends.llamacpp import guard

        if guard.library_dir() is None:
            return "llama-cpp-python is not installed: pip install llama-cpp-python"
        problem = guard.check()  # a build that dies here is refused, not loaded (probed once)
        return problem.line() if problem else None

    def capabilities(self) -> Capabilities:
        return Capabilities(kv_bits=frozenset({16, 8, 4}), split_kv=True, group_sizes=frozenset({32}), sinks_window=True,
                            batch=True,
                            notes=("quantized KV uses llama.cpp's q8_0 / q4_0 with flash attention",
                                   "sinks + window run through llama.cpp's context shift, with fp16 KV",
                                   "generate_batch decodes several sequences together (batch.py)"))

    def refusals(self, policy: KVPolicy, spec=None) -> list[str]:
        return self.capabilities().refusals(policy) + shift.refusals(policy, spec)

    def describe_kv(self, policy: KVPolicy) -> str:
        return shift.describe(policy)

    def kv_allocation(self):
        """llama.cpp's own allocation (allocation.py): cells padded to 256, compact sliding layers."""
        cal = shift.local_calibration()
        return lambda spec, policy, context: shift.settings_for_policy(policy, context, cal).cache().bytes(spec)

    def load(self, model: ModelRef, plan: Plan):
        if model.kind != "gguf":
            raise UserError(f"the llama.cpp backend loads GGUF files and {model.name} is an HF folder; "
                            "use --backend torch or a .gguf file")
        from localctx.backends.llamacpp.session import LlamaCppSession

        return LlamaCppSession(model, plan)
