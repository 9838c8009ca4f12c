"""Per-request KV policies: lanes on the one loaded model.

A lane is a group of stream slots with one KV policy and one context, on the weights the server
loaded once (torch: a session with its own KV pool on the shared model; llama.cpp: a context of
its own on the shared ``llama_model``; the fake backend: a session of its own). The server starts
with one lane, the plan it was started with; a request whose ``localctx.kv`` (or a smaller
``localctx.context``) no open lane serves gets a lane made for it on demand.

Every lane's KV counts against one budget: the started plan's KV bytes. A lane whose KV could
never fit that budget is refused (400); one that fits only once busy lanes finish is refused
with 503 and Retry-After; idle lanes are closed, least recently used first, to make room. A
lane whose KV lives in the session the server keeps (``pinned``: llama.cpp serving one stream at
a time, MLX) is never closed. Lanes run one after the other within a step: each reads the
weights once for its streams (different KV layouts do not share one forward).

Opening a lane allocates a KV pool (or a llama.cpp context) on the scheduler thread, so the
operator bounds it: ``opens_per_minute`` (``--kv-lanes N``; 0, the default, serves only the
started policy and refuses other ones with 400), and past that bound a request that needs a new
lane gets 503 with Retry-After. A lane maker that fails to open a lane, however it fails, is a
LaneRefused (500 unless it refused the request, 400), never an exception out of ``choose``."""
from __future__ import annotations

import dataclasses
import math
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from localctx.backends.generation.stream_source import StreamSource
from localctx.backends.machine.planner_inputs import backend_view
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec


class LaneMaker(ABC):
    """What a backend gives the lanes (app/serve/lane_makers.py): how to open a lane's streams on the
    shared weights, which policies it cannot serve per request (beyond the backend's own refusals;
    by default none), the KV bytes a lane counts (by default None: the backend's allocation,
    Backend.kv_allocation, else the cost model), and how to free a lane's streams (by default: close them)."""

    @abstractmethod
    def open(self, plan: Plan) -> StreamSource: ...

    def refusal(self, policy: KVPolicy) -> str | None:
        return None

    def kv_bytes(self, plan: Plan) -> int | None:
        return None

    def release(self, streams: StreamSource) -> None:
        streams.close()


class LaneRefused(Exception):
    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


@dataclass
class Lane:
    plan: Plan
    streams: StreamSource  # SlotBatcher, LlamaSlots or SequentialStreams
    kv_bytes: int  # what the lane counts against the budget: the backend's allocation for plan
    pinned: bool = False
    last_used: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not isinstance(self.streams, StreamSource):
            raise TypeError(f"a lane's streams must be a StreamSource, not {type(self.streams).__name__}")

    @property
    def busy(self) -> bool:
        return self.streams.active > 0

    @property
    def allocated_bytes(self) -> int:
        """KV the lane has allocated now: less than ``kv_bytes`` while its plan allocates less than its
        context and grows toward it (kvcache/growth.py), else all of it."""
        plan = self.plan
        return plan.allocated_bytes if plan.allocated_context < plan.context else self.kv_bytes

    def serves(self, policy: KVPolicy, context: int) -> bool:
        return str(self.plan.policy) == str(policy) and self.plan.context >= context

    def name(self) -> str:
        return f"{self.plan.policy} at {self.plan.context:,} tokens"


class Lanes:
    def __init__(self, spec: ModelSpec, served: Plan, streams: StreamSource, maker: LaneMaker, pinned: bool,
                 retry_after_s: int = 1, opens_per_minute: int = 0):
        self.spec = spec
        self.served = served
        self.maker = maker
        self.retry_after_s = retry_after_s
        self.opens_per_minute = opens_per_minute
        self._opened_at: deque[float] = deque()  # when lanes were opened on a request's word, the last minute
        self.view = backend_view(served.backend, spec)[0]
        first = Lane(served, streams, self.lane_bytes(served), pinned)
        self.budget = max(served.kv_bytes, first.kv_bytes)
        self.lanes: list[Lane] = [first]
        self.opened = 1
        self._widest = 0

    # -- what the HTTP side and the scheduler read ------------------------------------------
    @property
    def capacity(self) -> int:
        return max(lane.streams.capacity for lane in self.lanes) if self.lanes else 1

    @property
    def batching(self) -> bool:
        return any(lane.streams.batching for lane in self.lanes)

    @property
    def active(self) -> int:
        return sum(lane.streams.active for lane in self.lanes)

    @property
    def widest(self) -> int:
        return max([self._widest, *(lane.streams.widest for lane in self.lanes)])

    def used_bytes(self) -> int:
        return sum(lane.kv_bytes for lane in self.lanes)

    def allocated(self) -> tuple[int, int]:
        """(KV bytes, tokens) the open lanes have allocated now; each grows toward its plan's context."""
        return (sum(lane.allocated_bytes for lane in self.lanes),
                sum(lane.plan.allocated_context for lane in self.lanes))

    def describe(self) -> list[dict]:
        return [{"policy": str(lane.plan.policy), "context": lane.plan.context, "kv_bytes": lane.kv_bytes,
                 "active": lane.streams.active} for lane in self.lanes]

    def lane_bytes(self, plan: Plan) -> int:
        """The most KV a lane for ``plan`` holds: the backend's own count where it has one (torch's
        windowed slots), else its allocation (llama.cpp's padded cells), else the cost model."""
        own = self.maker.kv_bytes(plan)
        return own if own is not None else self.view.kv_bytes(self.spec, plan.policy, plan.context)

    # -- choosing and opening lanes ---------------------------------------------------------
    def choose(self, policy: KVPolicy | None, context: int | None) -> Lane:
        """The lane for a request: an open one that serves (policy, context), else a new one
        within the budget. Raises LaneRefused (the HTTP status and the reason)."""
        policy = policy or self.served.policy
        want = context or self.served.context
        fitting = [lane for lane in self.lanes if lane.serves(policy, want)]
        if fitting:
            return min(fitting, key=lambda lane: lane.plan.context)
        self._check_allowed(policy)
        self._check_runnable(policy)
        plan = self._plan(policy, want)
        if plan.kv_bytes > self.budget:
            raise LaneRefused(400, f"KV policy {policy} at {want:,} tokens needs {format_bytes(plan.kv_bytes)} of KV, "
                                   f"more than this server's KV budget of {format_bytes(self.budget)} (its plan: "
                                   f"{self.served.policy} at {self.served.context:,} tokens); send a smaller "
                                   "localctx.context or a smaller policy, or start a server with that --kv",
                              "kv_budget_exceeded")
        self._check_rate()
        whole = self._plan(policy, self.served.context) if want < self.served.context else plan
        if whole.kv_bytes <= self.budget - self.used_bytes():  # room for it without closing a lane: then a
            plan = whole  # lane at the served context serves later requests of any context
        need, want = plan.kv_bytes, plan.context
        closed = self._make_room(need, policy, want)
        self._opened_at.append(time.monotonic())
        try:
            streams = self.maker.open(plan)
        except Exception as exc:  # noqa: BLE001 - whatever the maker raised, the request gets a LaneRefused
            self._reopen(closed)  # the idle lanes closed for it were closed for nothing: bring them back
            if isinstance(exc, UserError):
                raise LaneRefused(400, f"KV policy {policy} at {want:,} tokens cannot be opened: {exc}",
                                  "kv_policy_unavailable") from None
            raise LaneRefused(500, f"opening a lane for KV policy {policy} at {want:,} tokens failed: "
                                   f"{type(exc).__name__}: {exc}", "kv_lane_failed") from exc
        lane = Lane(plan, streams, need)
        self.lanes.append(lane)
        self.opened += 1
        return lane

    def _check_allowed(self, policy: KVPolicy) -> None:
        """A new lane only where the operator allows lanes (--kv-lanes)."""
        if self.opens_per_minute <= 0:
            raise LaneRefused(400, f"this server serves only its own KV policy ({self.served.policy}); per-request "
                                   f"policies such as {policy} are off: omit localctx.kv, or start localctx serve "
                                   "with --kv-lanes N to open up to N lanes a minute", "kv_lanes_off")

    def _check_rate(self) -> None:
        """At most ``opens_per_minute`` lanes opened in the last minute."""
        now = time.monotonic()
        while self._opened_at and now - self._opened_at[0] >= 60.0:
            self._opened_at.popleft()
        if len(self._opened_at) >= self.opens_per_minute:
            wait = max(1, math.ceil(60.0 - (now - self._opened_at[0])))
            raise LaneRefused(503, f"this server opens at most {self.opens_per_minute} KV lanes a minute "
                                   f"(--kv-lanes) and has; retry after {wait} s, or send the policy an open lane "
                                   "serves (GET /v1/models lists them)", "kv_lanes_busy", wait)

    def _check_runnable(self, policy: KVPolicy) -> None:
        reasons = list(self.view.refusals(policy))
        own = self.maker.refusal(policy)
        if own:
            reasons.append(own)
        if reasons:
            raise LaneRefused(400, f"backend {self.served.backend} cannot run KV policy {policy}: "
                                   f"{'; '.join(reasons)}; "
                                   f"send another localctx.kv or omit it (this server's plan is {self.served.policy})",
                              "kv_policy_unavailable")

    def _plan(self, policy: KVPolicy, context: int) -> Plan:
        plan = Plan.fixed(self.served.backend, self.spec, policy, context, kv_layout=self.view.describe(policy),
                          reason=f"KV policy {policy} from the request's localctx.kv")
        plan = dataclasses.replace(plan, hardware=self.served.hardware)
        return dataclasses.replace(plan, kv_bytes=self.lane_bytes(plan))

    def _make_room(self, need: int, policy: KVPolicy, context: int) -> list[Lane]:
        """Closes idle lanes, least recently used first, until ``need`` bytes are free; returns them."""
        idle = sorted((lane for lane in self.lanes if not lane.busy and not lane.pinned), key=lambda l: l.last_used)
        free = self.budget - self.used_bytes()
        if free + sum(lane.kv_bytes for lane in idle) < need:
            held = ", ".join(f"{lane.name()} ({format_bytes(lane.kv_bytes)}{', busy' if lane.busy else ''}"
                             f"{', kept' if lane.pinned else ''})" for lane in self.lanes)
            later = free + sum(lane.kv_bytes for lane in self.lanes if not lane.pinned) >= need
            when = "retry after the Retry-After seconds" if later else \
                "the kept lane holds its KV in the session the server loaded; start a server with that --kv"
            raise LaneRefused(503 if later else 400,
                              f"KV policy {policy} at {context:,} tokens needs {format_bytes(need)} of KV and "
                              f"{format_bytes(max(free, 0))} of the server's {format_bytes(self.budget)} is free "
                              f"(held by {held}); {when}",
                              "kv_budget_busy" if later else "kv_budget_exceeded",
                              self.retry_after_s if later else None)
        closed = []
        while free < need:
            lane = idle.pop(0)
            self.close_lane(lane)
            closed.append(lane)
            free += lane.kv_bytes
        return closed

    def _reopen(self, closed: list[Lane]) -> None:
        """Opens again lanes that were closed to make room for a lane that then failed to open (their
        streams' KV is gone; the lanes serve as before). One that fails stays closed: a later request
        for its policy opens it on demand, as for any closed lane."""
        for old in closed:
            try:
                streams = self.maker.open(old.plan)
            except Exception:  # noqa: BLE001 - best effort: the request's own error is what the client gets
                continue
            self.lanes.append(Lane(old.plan, streams, old.kv_bytes, last_used=old.last_used))
            self.opened += 1

    def close_lane(self, lane: Lane) -> None:
        self._widest = max(self._widest, lane.streams.widest)
        self.lanes.remove(lane)
        self.maker.release(lane.streams)

    def used(self, lane: Lane) -> None:
        lane.last_used = time.monotonic()

    # -- the scheduler's loop ---------------------------------------------------------------
    def busy_lanes(self) -> list[Lane]:
        return [lane for lane in self.lanes if lane.busy]

    def close(self) -> None:
        for lane in list(self.lanes):
            self.lanes.remove(lane)
            lane.streams.close()
            if not lane.pinned:
                self.maker.release(lane.streams)
