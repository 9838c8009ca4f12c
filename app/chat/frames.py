"""Streamed tokens reach the screen in frames, not one by one.

The worker thread that decodes adds each event to a FrameBuffer; the screen takes everything that
arrived since its last frame, at most once per FRAME_INTERVAL. Per token the worker only appends
to a list under a lock, and it wakes the UI thread once per frame, not once per token: on a
2-core machine every bit of UI work is taken from the decoder's threads."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from localctx.backends.base import GenerationEvent, GenerationStats

FRAME_INTERVAL = 0.1  # seconds between two frames of a streaming answer (10 frames a second)


@dataclass(frozen=True)
class Frame:
    """What arrived since the previous frame."""
    turn: int
    text: str  # the streamed text, all pieces joined
    stats: GenerationStats | None  # the latest event's figures (None: no event arrived)
    events: int  # how many events it carries
    done: GenerationEvent | None = None  # the final event, once it arrived


class FrameBuffer:
    """Events of one answer (``turn``), added by the worker thread and taken by the UI thread."""

    def __init__(self, turn: int):
        self.turn = turn
        self._lock = threading.Lock()
        self._pieces: list[str] = []
        self._stats: GenerationStats | None = None
        self._events = 0
        self._done: GenerationEvent | None = None
        self._woken = False  # the UI was told there is something to take and has not taken it yet

    def add(self, event: GenerationEvent) -> bool:
        """Keeps ``event``; True when the UI has to be woken: the first event since it last took, or the end."""
        with self._lock:
            if event.text:
                self._pieces.append(event.text)
            self._stats = event.stats
            self._events += 1
            if event.kind == "done":
                self._done = event
            wake = not self._woken or event.kind == "done"  # the end is drawn at once, not a frame later
            self._woken = True
            return wake

    @property
    def finished(self) -> bool:
        """The final event is waiting to be taken (the screen draws it without waiting for a frame)."""
        with self._lock:
            return self._done is not None

    def take(self) -> Frame:
        with self._lock:
            frame = Frame(self.turn, "".join(self._pieces), self._stats, self._events, self._done)
            self._pieces = []
            self._stats = None
            self._events = 0
            self._done = None
            self._woken = False
            return frame
