"""What ``localctx serve``'s scheduler drives (app/serve/scheduler.py): a source of streams over
one loaded session. ``StreamSource`` is the contract; the sources are ``SequentialStreams`` (here:
one stream at a time on any Session, whose own cache keeps the last conversation, so a follow-up
turn prefills only its new tokens) and the batching ones over conversation slots
(backends/generation/slots.SlotStreams): torch's ``SlotBatcher`` (backends/torch/serving.py) and
llama.cpp's ``LlamaSlots`` (backends/llamacpp/serving.py), continuous batching with per-slot KV
reuse. Which one a server runs is chosen in app/serve/streams.py."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generator, Iterator

from localctx.backends.base import GenerationEvent, GenerationParams, Prompt, Session


class StreamSource(ABC):
    """A source of streams over one loaded ``session``, driven from one thread (the scheduler's).

    ``start(prompt, params, cancel)`` admits a request and returns ``(stream, first event)``, or
    ``(stream, None)`` when the source prefills it in its next ``step`` (which then returns its first
    event: the torch batcher does, so that streams joining together prefill together), or None when
    it has to wait (no free slot, or not enough KV now); it raises UserError for a request that can
    never run (the server answers 400) and any other exception when the backend failed.

    ``step()`` advances every live stream by one token and returns ``(stream, event)`` for each; a
    stream whose event is "done" has ended. When ``step`` raises, the backend failed: the caller
    fails every live stream and ends them with ``cancel_all``.
    A stream is an opaque key: the caller only compares it (``id(stream)``).
    ``cancel_all()`` ends every live stream; ``close()`` also frees what the source holds.

    ``batching``: whether live streams are decoded together; ``active``: live streams now;
    ``capacity``: the most live at once; ``widest``: the most streams decoded in one step so far."""

    session: Session
    widest: int

    @property
    @abstractmethod
    def batching(self) -> bool: ...

    @property
    @abstractmethod
    def active(self) -> int: ...

    @property
    @abstractmethod
    def capacity(self) -> int: ...

    @abstractmethod
    def start(self, prompt: Prompt, params: GenerationParams, cancel: threading.Event | None
              ) -> tuple[object, GenerationEvent | None] | None: ...

    @abstractmethod
    def step(self) -> list[tuple[object, GenerationEvent]]: ...

    @abstractmethod
    def cancel_all(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


@dataclass
class OneStream:
    events: Iterator[GenerationEvent]


class SequentialStreams(StreamSource):
    """One stream at a time on any Session, through ``Session.generate``."""

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

    def start(self, prompt: Prompt, params: GenerationParams,
              cancel: threading.Event | None) -> tuple[OneStream, GenerationEvent] | None:
        if self.current is not None:
            return None
        one = OneStream(iter(self.session.generate(prompt, params, cancel)))
        self.current = one
        return one, self._next(one)

    def _next(self, one: OneStream) -> GenerationEvent:
        """The stream's next event; the stream ends when that is "done" or when it raises."""
        try:
            event = next(one.events)
        except BaseException:
            self._end()
            raise
        if event.kind == "done":
            self._end()
        return event

    def _end(self) -> None:
        one, self.current = self.current, None
        if one is not None and isinstance(one.events, Generator):
            one.events.close()

    def step(self) -> list[tuple[OneStream, GenerationEvent]]:
        one = self.current
        if one is None:
            return []
        return [(one, self._next(one))]

    def cancel_all(self) -> None:
        self._end()

    def close(self) -> None:
        self._end()
