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


@dataclass(frozen=True)
class StreamFailed:
    """What ``step`` gives for a stream that failed alone (its sampler, its prefill, its text): the
    stream has ended and its slot is free; the other streams go on."""
    message: str


class StreamSource(ABC):
    """A source of streams over one loaded ``session``, driven from one thread (the scheduler's).

    ``tokenize(prompt)`` gives the prompt's token ids, or None where the source tokenizes inside
    ``start`` (SequentialStreams: its session does, one stream at a time). It only reads the
    tokenizer, so the server calls it on another thread, and hands the ids to ``start``.

    ``start(prompt, params, cancel, ids)`` admits a request and returns ``(stream, first event)``, or
    ``(stream, None)`` when the source prefills it in later ``step``s (which then return its first
    event: the batching sources do, a chunk of prompt per step, so that a long prompt delays the
    other streams by at most one chunk), or None when it has to wait (no free slot, or not enough
    KV now); it raises UserError for a request that can never run (the server answers 400) and any
    other exception when it failed. Whatever ``start`` raises, it holds nothing afterwards: no slot
    stays taken.

    ``step()`` advances every live stream by one token (or one prefill chunk) and returns
    ``(stream, event)`` for each stream that has one: a GenerationEvent ("done" ends the stream) or
    a ``StreamFailed`` (that stream alone failed and has ended; a forward that several streams
    share fails each of them). When ``step`` itself raises, the source is broken: the caller fails
    every live stream and ends them with ``cancel_all``.
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

    def tokenize(self, prompt: Prompt) -> list[int] | None:
        return None

    @abstractmethod
    def start(self, prompt: Prompt, params: GenerationParams, cancel: threading.Event | None,
              ids: list[int] | None = None) -> tuple[object, GenerationEvent | None] | None: ...

    @abstractmethod
    def step(self) -> list[tuple[object, GenerationEvent | StreamFailed]]: ...

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

    def start(self, prompt: Prompt, params: GenerationParams, cancel: threading.Event | None,
              ids: list[int] | None = None) -> tuple[OneStream, GenerationEvent] | None:
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

    def step(self) -> list[tuple[OneStream, GenerationEvent | StreamFailed]]:
        one = self.current
        if one is None:
            return []
        try:
            return [(one, self._next(one))]
        except Exception as exc:  # noqa: BLE001 - this stream's failure, reported as its own (it has ended)
            return [(one, StreamFailed(f"{type(exc).__name__}: {exc}"))]

    def cancel_all(self) -> None:
        self._end()

    def close(self) -> None:
        self._end()
