"""The ``openai`` backend: OpenAI-compatible servers run the model and its KV cache (session.py
talks to them). It is opened from --endpoint URLs (``open_remote``), never loaded from a model file."""
from __future__ import annotations

from localctx.backends.base import Backend, Capabilities, Session
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan


class RemoteBackend(Backend):
    name = "openai"

    def capabilities(self) -> Capabilities:
        return Capabilities(kv_bits=frozenset({16, 8, 4}), split_kv=True, residual=True, sinks_window=True, heavy=True, batch=True,
                            notes=("the server runs the model and its KV cache; localctx serve takes the policy "
                                   "per request, other servers keep their own",))

    def load(self, model, plan: Plan) -> Session:
        raise UserError("the openai backend talks to a server: give --endpoint URL (see localctx run --help)")
