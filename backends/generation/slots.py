"""Conversation slots for a server: a slot is a KV sequence that outlives its request and
remembers the tokens it holds, so a follow-up turn can keep the longest common prefix."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


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
