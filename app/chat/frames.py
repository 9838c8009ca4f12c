"""Streamed tokens reach the screen in frames, not one by one.

The worker thread that decodes adds each event to a FrameBuffer; the screen takes everything that
arrived since its last frame. Per token the worker only appends to a list under a lock, and it
wakes the UI thread once per frame, not once per token: on a 2-core machine every bit of UI work
is taken from the decoder's threads. FramePacer spaces the frames: FRAME_INTERVAL apart, or, where
the decoder keeps every core busy, further apart when drawing them costs the UI thread more than
UI_SHARE of its time (ui_has_own_core says which)."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from localctx.backends.base import GenerationEvent, GenerationStats

FRAME_INTERVAL = 0.1  # seconds between two frames of a streaming answer (at most 10 frames a second)
# Where the decoder keeps every core busy, at most this share of one core goes to the UI thread while
# an answer streams. llama.cpp's threads spin-wait for each other, so a core's time taken by the UI
# stalls them all: the decoder loses about what the UI takes (docs/benchmarks.md, "The chat against
# `localctx run`"). Where the UI has a core of its own (ui_has_own_core) frames are not held back.
UI_SHARE = 0.02
# However slow the drawing, the answer moves at least every MAX_INTERVAL. On a 2-core host under
# load a frame of a long answer costs the UI thread 20-40 ms: at a 1 s cap the UI took ~4% of a core
# and the chat decoded ~5% slower than `localctx run`; 2 s lets the pacer keep its UI_SHARE there.
MAX_INTERVAL = 2.0


def usable_cpus() -> int:
    """Cores this process may run on (its affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def ui_has_own_core(decode_threads: int | None, decodes_here: bool) -> bool:
    """Whether drawing a frame takes nothing from the decoder: a server elsewhere decodes (no thread
    here), or the model decodes in another process (no GIL shared) on fewer threads than there are
    cores (a GPU driven from one thread, llama.cpp on the physical cores of an SMT machine).
    ``decode_threads``: Session.decode_threads (None: every core)."""
    if decode_threads == 0:
        return True
    return not decodes_here and decode_threads is not None and decode_threads < usable_cpus()


def paced(ui_seconds: float, at_least: float) -> float:
    """Seconds between two frames where the UI spent ``ui_seconds`` since the last one: enough that it
    is at most UI_SHARE of them, not under ``at_least``, not over MAX_INTERVAL."""
    return min(MAX_INTERVAL, max(at_least, ui_seconds / UI_SHARE))


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


class FramePacer:
    """When the next frame is due. The UI thread's CPU time between two frames is what drawing the
    last one cost (layout and render included); the next frame waits until that cost is at most
    UI_SHARE of the time between frames, and never less than FRAME_INTERVAL. The time the UI has spent
    since the last frame counts as soon as it is spent (``wait`` reads it), so the frame just drawn,
    whose layout runs after the screen's draw call returns, holds back the next one at once, not only
    the one after (the answer's second frame no longer comes FRAME_INTERVAL after its first whatever
    the first cost). Where the UI has a core of its own (``own_core``, from ui_has_own_core) frames
    come every FRAME_INTERVAL whatever they cost."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.thread_time):
        self._clock = clock
        self._cpu = cpu  # CPU seconds of the calling thread: always called from the UI thread
        self._last_wall: float | None = None
        self._last_cpu = 0.0
        self.interval = FRAME_INTERVAL
        self.own_core = False  # until the loaded session says otherwise: the decoder may need every core

    def wait(self) -> float:
        """Seconds until the next frame may be drawn (0: now): ``interval`` after the last one, or
        longer while the UI time spent since it asks for more. Call from the UI thread, again when
        that time has passed (the UI may have spent more meanwhile)."""
        if self._last_wall is None:
            return 0.0
        gap = self.interval if self.own_core else paced(self._cpu() - self._last_cpu, self.interval)
        return max(0.0, self._last_wall + gap - self._clock())

    def drawn(self) -> None:
        """Call when a frame is drawn: the UI time spent since the last one sets the next interval."""
        wall, cpu = self._clock(), self._cpu()
        if self._last_wall is not None and not self.own_core:
            self.interval = paced(cpu - self._last_cpu, FRAME_INTERVAL)
        self._last_wall, self._last_cpu = wall, cpu

    def reset(self) -> None:
        """A new answer: its first frame is drawn at once."""
        self._last_wall = None
        self.interval = FRAME_INTERVAL
