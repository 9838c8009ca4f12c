"""Conversation slots for a server: a slot is a KV sequence that outlives its request and
remembers the tokens it holds, so a follow-up turn can keep the longest common prefix.
``SlotStreams`` is what the batching stream sources share."""
from __future__ import annotations

import contextlib
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from localctx.backends.base import GenerationEvent, Prompt
from localctx.backends.generation.stream_source import StreamFailed, StreamSource


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Slot:
    seq_id: int
    history: list[int] = field(default_factory=list)  # exactly the tokens the slot's cache holds
    busy: bool = False
    last_used: float = 0.0


def choose_slot(slots: list[Slot], ids: list[int]) -> tuple[Slot, int] | None:
    """The idle slot whose conversation this prompt continues (it shares at least half of what
    the slot holds: a re-tokenized answer may differ from the sampled tokens near its end);
    else an empty slot; else the least recently used one. Returns (slot, shared prefix)."""
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    best = max(idle, key=lambda s: common_prefix(s.history, ids))
    shared = common_prefix(best.history, ids)
    if shared and 2 * shared >= len(best.history):
        return best, shared
    empty = [s for s in idle if not s.history]
    slot = empty[0] if empty else min(idle, key=lambda s: s.last_used)
    return slot, common_prefix(slot.history, ids)


class SlotStreams(StreamSource):
    """A batching StreamSource over conversation slots (torch's SlotBatcher, llama.cpp's LlamaSlots).

    Each live stream has a ``slot`` and ``events`` (its event stream; None until the source has
    prefilled its prompt, a chunk per step). A stream that ends leaves its slot idle and holding
    its conversation, unless it failed or the slot's cache is out of step with its ``history``
    (``_in_step``): then the slot forgets it (``_forget``). The one invariant: every way a stream
    ends — done, cancelled, failed alone, failed with a shared forward, ``start`` raising after it
    took its slot — goes through ``_end``, which frees the slot."""

    def __init__(self, session, slots: list[Slot]):
        self.session = session
        self.slots = slots
        self.live: list = []
        self.widest = 0  # most streams decoded in one step so far

    @property
    def batching(self) -> bool:
        return True

    @property
    def active(self) -> int:
        return len(self.live)

    @property
    def capacity(self) -> int:
        return len(self.slots)

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.session.tokenize(prompt)

    @abstractmethod
    def _in_step(self, live) -> bool:
        """Whether ``live``'s slot holds exactly the tokens of its history in its cache."""

    @abstractmethod
    def _forget(self, slot: Slot) -> None:
        """Drops ``slot``'s cached tokens and history."""

    def _free(self, live) -> None:
        """Frees what ``live`` holds beyond its slot (nothing, unless the source says otherwise)."""

    def _end(self, live, failed: bool = False) -> None:
        if live in self.live:
            self.live.remove(live)
        slot = live.slot
        try:
            if live.events is not None:
                live.events.close()
            self._free(live)
        finally:  # the slot is returned whatever closing its stream did
            slot.busy = False
            slot.last_used = time.monotonic()
            if failed or not self._in_step(live):
                self._forget(slot)  # failed, or cache and history out of step: forget the conversation

    @contextlib.contextmanager
    def _end_on_error(self, live: list) -> Iterator[None]:
        """Ends every stream of ``live``, failed, when the block raises, and raises on (``start``,
        after the stream took its slot)."""
        try:
            yield
        except BaseException:
            for s in live:
                self._end(s, failed=True)
            raise

    def _fail(self, live: list, exc: BaseException, what: str) -> list[tuple[object, StreamFailed]]:
        """Ends each stream of ``live``, failed (``what`` failed for them: their caches cannot be
        trusted); returns their StreamFailed events."""
        failed = StreamFailed(f"{what} failed: {type(exc).__name__}: {exc}")
        for s in live:
            self._end(s, failed=True)
        return [(s, failed) for s in live]

    def _next_events(self, live: list) -> list[tuple[object, GenerationEvent | StreamFailed]]:
        """Each stream's next event, in order; a stream whose event is "done" ends, and one whose
        event stream raises (its sampler, its text) fails alone."""
        out: list = []
        for s in live:
            try:
                event = next(s.events)
            except Exception as exc:  # noqa: BLE001 - this stream's own failure
                out += self._fail([s], exc, "the stream")
                continue
            out.append((s, event))
            if event.kind == "done":
                self._end(s)
        return out

    def cancel_all(self) -> None:
        for s in list(self.live):
            self._end(s, failed=True)

    def close(self) -> None:
        self.cancel_all()
