"""What the scheduler drives: a source of streams over one loaded session.

``start(prompt, params, cancel)`` prefills a request and returns (stream, first event), or None
when it has to wait; ``step()`` advances every live stream by one token and returns their events.
A source may return (stream, None) instead and prefill the stream in its next ``step``, which then
returns its first event (the torch batcher does, so that streams joining together prefill together).
Torch and llama.cpp sessions batch (``backends.torch.serving.SlotBatcher``,
``backends.llamacpp.serving.LlamaSlots``: continuous batching, per-slot KV reuse); other
backends run one stream at a time through ``Session.generate``, whose own cache keeps the last
conversation (a follow-up turn prefills only its new tokens)."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Generator, Iterator

from localctx.backends.base import GenerationEvent, GenerationParams, Prompt, Session
from localctx.kvcache import cost


@dataclass
class OneStream:
    events: Iterator[GenerationEvent]


class SequentialStreams:
    """One stream at a time on any Session."""

    def __init__(self, session: Session):
        self.session = session
        self.current: OneStream | None = None
        self.widest = 1

    @property
    def batching(self) -> bool:
        return False

    @property
    def active(self) -> int:
        return 1 if self.current else 0

    @property
    def capacity(self) -> int:
        return 1

    def kv_bytes(self) -> int:
        return 0  # reported per stream by the session's own events

    def start(self, prompt: Prompt, params: GenerationParams,
              cancel: threading.Event | None) -> tuple[OneStream, GenerationEvent] | None:
        if self.current is not None:
            return None
        one = OneStream(iter(self.session.generate(prompt, params, cancel)))
        self.current = one
        try:
            first = next(one.events)
        except BaseException:
            self._end()
            raise
        if first.kind == "done":
            self._end()
        return one, first

    def _end(self) -> None:
        one, self.current = self.current, None
        if one is not None and isinstance(one.events, Generator):
            one.events.close()

    def step(self) -> list[tuple[OneStream, GenerationEvent]]:
        one = self.current
        if one is None:
            return []
        try:
            event = next(one.events)
        except BaseException:
            self._end()
            raise
        if event.kind == "done":
            self._end()
        return [(one, event)]

    def cancel_all(self) -> None:
        self._end()

    def close(self) -> None:
        self._end()


def open_streams(planned, parallel: int) -> tuple[Session, object]:
    """Loads ``planned`` (app/session_options.PlannedSession) for a server: (session, streams).
    On llama.cpp the batched slots hold the plan's KV in their own context, and the session keeps
    only a minimal one beside them (serving.open_slots)."""
    plan = planned.plan
    if parallel > 1 and plan.backend == "llamacpp" and not plan.policy.evicts:
        from localctx.backends.llamacpp.serving import open_slots

        slots = open_slots(planned.ref, plan, parallel, planned.cache_reuse)
        return slots.session, slots
    session = planned.load()
    return session, make_streams(session, parallel)


def make_streams(session: Session, parallel: int):
    """Continuous batching where the backend supports it (torch; llama.cpp unless the policy
    evicts through its context shift), else one at a time."""
    if parallel > 1 and session.backend_name == "llamacpp" and not session.plan.policy.evicts:
        from localctx.backends.llamacpp.session import LlamaCppSession
        from localctx.backends.llamacpp.serving import LlamaSlots

        if isinstance(session, LlamaCppSession):
            return LlamaSlots(session, parallel)
    if parallel > 1 and session.backend_name == "torch":  # torch is imported only when it is the backend
        from localctx.backends.torch.serving import SlotBatcher
        from localctx.backends.torch.session import TorchSession

        if isinstance(session, TorchSession):
            return SlotBatcher(session, parallel)
    return SequentialStreams(session)


# -- lanes: per-request KV policies on the loaded weights (app/serve/lanes.py) --------------------
class TorchLanes:
    """A lane is a TorchSession of its own (its own KV pool) on the served session's model."""

    def __init__(self, session, parallel: int):
        self.session, self.parallel = session, parallel

    def refusal(self, policy) -> str | None:
        return None

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

    def open(self, plan):
        from localctx.backends.torch.loading import LoadedModel, build_session

        s = self.session
        lane = build_session(LoadedModel(s.engine.model, s.tokenizer, s.spec), plan, s.options)
        return make_streams(lane, self.parallel)

    def release(self, streams) -> None:
        streams.close()
        streams.session.release_kv()


class LlamaCppLanes:
    """A lane is a context of its own on the served session's ``llama_model`` (llama_init_from_model
    on the shared weights, as the batched slots already are), with the lane's K and V types."""

    def __init__(self, session, parallel: int, cache_reuse: int):
        self.session, self.parallel, self.cache_reuse = session, parallel, cache_reuse

    def refusal(self, policy) -> str | None:
        if policy.evicts:
            return ("on llama.cpp sinks + window run through the context shift of the session's own context, which "
                    "holds the policy the server was started with; a per-request lane holds fp16, int8 or int4 KV")
        return None

    def kv_bytes(self, plan) -> int | None:
        return None  # the backend's own allocation (Backend.kv_allocation), else the cost model

    def open(self, plan):
        from localctx.backends.llamacpp.serving import LlamaSlots

        return LlamaSlots(self.session, self.parallel, self.cache_reuse, plan=plan)

    def release(self, streams) -> None:
        streams.close()


class FakeLanes:
    """The fake backend has no weights: a lane is a fake session of its own."""

    def __init__(self, session):
        self.session = session

    def refusal(self, policy) -> str | None:
        return None

    def kv_bytes(self, plan) -> int | None:
        return None  # the backend's own allocation (Backend.kv_allocation), else the cost model

    def open(self, plan):
        from localctx.backends.fake.session import FakeSession

        return SequentialStreams(FakeSession(plan, self.session.delay))

    def release(self, streams) -> None:
        streams.close()


class OnePolicy:
    """Backends without lanes (MLX) serve the policy they were started with."""

    def __init__(self, backend: str):
        self.backend = backend

    def refusal(self, policy) -> str | None:
        return (f"the {self.backend} backend serves only the KV policy it was started with (per-request policies "
                "run on torch, llama.cpp and the fake backend)")

    def kv_bytes(self, plan) -> int | None:
        return None  # the backend's own allocation (Backend.kv_allocation), else the cost model

    def open(self, plan):
        raise AssertionError("refusal() refuses every policy a lane would open")

    def release(self, streams) -> None:
        streams.close()


def open_lanes(session: Session, streams, retry_after_s: int = 1):
    """The lanes of a server whose first lane is ``streams`` over ``session``, with the session's plan
    (on llama.cpp slots the session's own context is minimal: the slots hold that plan's KV)."""
    from localctx.app.serve.lanes import Lanes

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
    return Lanes(session.spec, session.plan, streams, maker, pinned, retry_after_s)
