"""Growing a KV allocation toward the plan's context (docs/architecture.md "KV sized to the work").

A session or a server starts with less KV than its plan's ``context`` (``Plan.allocated``) and grows
when a prompt and its answer need more: to at least double what it has, enough for the need, in
whole cells of its backend, never past the maximum. One rule for every place that grows — a chat's
session (backends/llamacpp/session.py, backends/torch/session.py) and a server's slots
(backends/llamacpp/serving.py, backends/torch/serving.py) — so they grow in the same steps; each
backend moves what it holds into the larger allocation its own way and records it with
``Plan.grow_to``."""
from __future__ import annotations


def next_size(current: int, needed: int, maximum: int, cell: int) -> int:
    """The allocation to grow to from ``current`` tokens: at least double, enough for ``needed``, in
    whole ``cell``-token cells, at most ``maximum``."""
    want = max(2 * current, -(-needed // cell) * cell)
    return min(maximum, want)


def must_grow(current: int, needed: int, maximum: int) -> bool:
    """Whether an allocation of ``current`` tokens grows for ``needed`` (never past ``maximum``)."""
    return needed > current and current < maximum
