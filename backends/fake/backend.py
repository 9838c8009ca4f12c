"""The fake backend: what the surfaces' tests run against (session.py says how it answers). The
CLI does not offer it; the test suite registers it (tests/conftest.py)."""
from __future__ import annotations

import os

from localctx.backends.base import Backend, Capabilities
from localctx.backends.fake.session import FakeSession
from localctx.kvcache.plan import Plan


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, delay: float | None = None):
        self.delay = float(os.environ.get("LOCALCTX_FAKE_DELAY", "0")) if delay is None else delay

    def capabilities(self) -> Capabilities:
        return Capabilities(kv_bits=frozenset({16, 8, 4}), split_kv=True, residual=True, sinks_window=True, heavy=True,
                            batch=True)

    def load(self, model, plan: Plan) -> FakeSession:
        return FakeSession(plan, self.delay)
