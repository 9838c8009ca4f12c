"""What the scheduler drives: a source of streams over one loaded session.

``start(prompt, params, cancel)`` prefills a request and returns (stream, first event), or None
when it has to wait; ``step()`` advances every live stream by one token and returns their events.
Torch and llama.cpp sessions batch (``backends.torch.serving.SlotBatcher``,
``backends.llamacpp_serving.LlamaSlots``: continuous batching, per-slot KV reuse); other
backends run one stream at a time through ``Session.generate``, whose own cache keeps the last
conversation (a follow-up turn prefills only its new tokens)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Generator, Iterator

from localctx.backends.base import GenerationEvent, GenerationParams, Prompt, Session


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
    only a minimal one beside them (llamacpp_serving.open_slots)."""
    plan = planned.plan
    if parallel > 1 and plan.backend == "llamacpp" and not plan.policy.evicts:
        from localctx.backends.llamacpp_serving import open_slots

        slots = open_slots(planned.ref, plan, parallel, planned.cache_reuse)
        return slots.session, slots
    session = planned.load()
    return session, make_streams(session, parallel)


def make_streams(session: Session, parallel: int):
    """Continuous batching where the backend supports it (torch; llama.cpp unless the policy
    evicts through its context shift), else one at a time."""
    if parallel > 1 and session.backend_name == "llamacpp" and not session.plan.policy.evicts:
        from localctx.backends.llamacpp import LlamaCppSession
        from localctx.backends.llamacpp_serving import LlamaSlots

        if isinstance(session, LlamaCppSession):
            return LlamaSlots(session, parallel)
    if parallel > 1 and session.backend_name == "torch":  # torch is imported only when it is the backend
        from localctx.backends.torch.serving import SlotBatcher
        from localctx.backends.torch.session import TorchSession

        if isinstance(session, TorchSession):
            return SlotBatcher(session, parallel)
    return SequentialStreams(session)
