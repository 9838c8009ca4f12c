"""What each backend gives serve's lanes (app/serve/lanes.py, the LaneMaker contract): how a lane
for another KV policy opens its streams on the weights the server loaded once, which policies it
cannot open, what its KV counts against the budget, and how its streams are freed."""
from __future__ import annotations

import dataclasses

from localctx.app.serve.lanes import LaneMaker, Lanes
from localctx.app.serve.streams import make_streams
from localctx.backends.base import Session
from localctx.backends.generation.stream_source import SequentialStreams, StreamSource
from localctx.kvcache import cost


class TorchLanes(LaneMaker):
    """A lane is a TorchSession of its own (its own KV pool) on the served session's model."""

    def __init__(self, session, parallel: int):
        self.session, self.parallel = session, parallel

    def kv_bytes(self, plan) -> int | None:
        """A windowed policy cache's pool (backends/torch/loading.build_session) lets each slot hold
        its window: counted as that many held tokens at the policy's precision. Others: the cost model."""
        policy = plan.policy
        if not policy.evicts:
            return None
        options, held = self.session.options, policy.capacity() + policy.group_size
        pool = max(options.pool_tokens or plan.context, held + options.prefill_chunk)
        unwindowed = dataclasses.replace(policy, sinks=0, window=None, heavy=0)
        return cost.max_kv_bytes(self.session.spec, unwindowed, min(pool, self.parallel * held))

    def open(self, plan) -> StreamSource:
        from localctx.backends.torch.loading import LoadedModel, build_session

        s = self.session
        lane = build_session(LoadedModel(s.engine.model, s.tokenizer, s.spec), plan, s.options)
        return make_streams(lane, self.parallel)

    def release(self, streams: StreamSource) -> None:
        streams.close()
        streams.session.release_kv()


class LlamaCppLanes(LaneMaker):
    """A lane is a context of its own on the served session's ``llama_model`` (llama_init_from_model
    on the shared weights, as the batched slots already are), with the lane's K and V types."""

    def __init__(self, session, parallel: int, cache_reuse: int):
        self.session, self.parallel, self.cache_reuse = session, parallel, cache_reuse

    def refusal(self, policy) -> str | None:
        if policy.evicts:
            return ("on llama.cpp sinks + window run through the context shift of the session's own context, which "
                    "holds the policy the server was started with; a per-request lane holds fp16, int8 or int4 KV")
        return None

    def open(self, plan) -> StreamSource:
        from localctx.backends.llamacpp.serving import LlamaSlots

        return LlamaSlots(self.session, self.parallel, self.cache_reuse, plan=plan)


class FakeLanes(LaneMaker):
    """The fake backend has no weights: a lane is a fake session of its own."""

    def __init__(self, session):
        self.session = session

    def open(self, plan) -> StreamSource:
        from localctx.backends.fake.session import FakeSession

        return SequentialStreams(FakeSession(plan, self.session.delay))


class OnePolicy(LaneMaker):
    """Backends without lanes (MLX) serve the policy they were started with."""

    def __init__(self, backend: str):
        self.backend = backend

    def refusal(self, policy) -> str | None:
        return (f"the {self.backend} backend serves only the KV policy it was started with (per-request policies "
                "run on torch, llama.cpp and the fake backend)")

    def open(self, plan) -> StreamSource:
        raise AssertionError("refusal() refuses every policy a lane would open")


def open_lanes(session: Session, streams: StreamSource, retry_after_s: int = 1, opens_per_minute: int = 0) -> Lanes:
    """The lanes of a server whose first lane is ``streams`` over ``session``, with the session's plan
    (on llama.cpp slots the session's own context is minimal: the slots hold that plan's KV)."""
    name = session.backend_name
    maker, pinned = OnePolicy(name), True
    if name == "torch":
        from localctx.backends.torch.session import TorchSession

        if isinstance(session, TorchSession):
            maker, pinned = TorchLanes(session, streams.capacity), False
    elif name == "llamacpp":
        from localctx.backends.llamacpp.serving import LlamaSlots

        slots = isinstance(streams, LlamaSlots)
        maker = LlamaCppLanes(session, streams.capacity, streams.cache_reuse if slots else 0)
        pinned = not slots  # one stream at a time: its KV is the session's own context
    elif name == "fake":
        maker, pinned = FakeLanes(session), False
    return Lanes(session.spec, session.plan, streams, maker, pinned, retry_after_s, opens_per_minute)
