"""The scheduler thread: it alone touches the model. Requests wait in a bounded queue (a full
queue is refused at once, 503); the oldest waiting one starts as soon as the stream source has
room (a slot, and KV within the plan), and every live stream advances one token per step.

A job talks back through ``emit``: first either a ``Refused`` (nothing was generated: the HTTP
side answers with that status) or the first GenerationEvent, then events up to "done", or a
``Failed`` if its stream failed mid-way. Setting ``job.cancel`` (client gone, deadline passed)
ends a live stream at its next token (or prefill chunk) and drops a waiting one.

Whatever fails — a lane that cannot open, a sampler that cannot be built, a prefill, a decode
step, this loop itself — fails the requests it touched, not the thread: the scheduler goes on
serving the others (the stream sources return the slots: backends/generation/slots.py). The
prompt is tokenized before the job is submitted (``tokenize``, on the HTTP side's worker thread),
so a long prompt's tokenization does not stall the streams this thread decodes."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from localctx.app.serve.lane_makers import open_lanes
from localctx.app.serve.lanes import Lane, LaneRefused, Lanes
from localctx.backends.base import GenerationParams, Prompt, Session, check_prompt_fits
from localctx.backends.generation.stream_source import StreamFailed, StreamSource
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


@dataclass(frozen=True)
class Refused:
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass
class ServeJob:
    prompt: Prompt
    params: GenerationParams
    emit: Callable[[object], None]
    context: int | None = None  # the request's own context limit (at most the plan's)
    policy: KVPolicy | None = None  # the request's KV policy (localctx.kv); None: the served one
    timeout_s: float = 600.0
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    timed_out: bool = False
    lane: Lane | None = None  # set when it starts: the lane it runs in, whose plan the response reports
    ids: list[int] | None = None  # the prompt's tokens (Scheduler.tokenize), where the source takes them
    n_prompt: int | None = None  # how many tokens the prompt has, when known before it starts


@dataclass(frozen=True)
class Limits:
    max_queue: int = 32  # requests waiting beyond the live ones; more are refused with 503
    queue_timeout_s: float = 120.0  # a request that waited this long is refused with 503
    retry_after_s: int = 1
    kv_lanes_per_min: int = 0  # --kv-lanes: lanes for other KV policies opened a minute at most (0: none)


log = logging.getLogger("localctx.serve")


class Scheduler:
    def __init__(self, session: Session, streams: StreamSource, limits: Limits = Limits()):
        """``streams``: the first lane's stream source (streams.make_streams / open_streams); lanes for
        other KV policies open beside it on demand (lanes.py)."""
        self.session = session
        self.streams: Lanes = open_lanes(session, streams, limits.retry_after_s, limits.kv_lanes_per_min)
        self._tokenizer = streams  # the served lane's source: every lane shares its tokenizer
        self.limits = limits
        self._waiting: deque[ServeJob] = deque()
        self._live: dict[int, ServeJob] = {}  # id(stream) -> job
        self._cond = threading.Condition()
        self._stopping = False
        self.served = 0
        self._thread = threading.Thread(target=self._loop, name="localctx-scheduler", daemon=True)
        self._thread.start()

    # -- the HTTP side ---------------------------------------------------------------------
    def submit(self, job: ServeJob) -> bool:
        """False when the queue is full (the caller answers 503 with Retry-After)."""
        with self._cond:
            if self._stopping or len(self._waiting) >= self.limits.max_queue:
                return False
            self._waiting.append(job)
            self._cond.notify()
            return True

    def tokenize(self, prompt: Prompt) -> tuple[list[int] | None, int]:
        """(the prompt's tokens where the stream source takes them, else None; their count): called
        off this thread, before ``submit``. It only reads the tokenizer."""
        ids = self._tokenizer.tokenize(prompt)
        return ids, len(ids) if ids is not None else self.session.count_tokens(prompt)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def load(self) -> dict:
        with self._cond:
            queued = len(self._waiting)
        active = self.streams.active
        return {"queued": queued, "active": active, "slots": self.streams.capacity,
                "free": max(0, self.streams.capacity - active - queued), "max_queue": self.limits.max_queue,
                "served": self.served}

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify()
        for job in waiting:
            job.emit(Refused(503, "the server is shutting down", type="server_error", code="shutting_down"))
        for job in list(self._live.values()):
            job.cancel.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.streams.close()  # the thread that owned the model is done with it

    # -- the thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._live:
                    self._cond.wait(0.5)
                if self._stopping and not self._live:
                    return
            try:
                self._admit()
                self._check_deadlines()
                if self._live:
                    self._step()
                else:
                    with self._cond:
                        if self._waiting:
                            self._cond.wait(0.05)  # nothing live and nothing could start: do not spin
            except Exception as exc:  # noqa: BLE001 - a bug here must not take the server down with it
                log.exception("the scheduler failed; failing the live requests and going on")
                self._fail_live(f"the server failed: {type(exc).__name__}: {exc}")

    def _fail_live(self, message: str) -> None:
        for lane in self.streams.busy_lanes():
            lane.streams.cancel_all()
        for key, job in list(self._live.items()):
            job.emit(Failed(message))
            del self._live[key]

    def _admit(self) -> None:
        self._drop_cancelled()
        while True:
            with self._cond:
                if not self._waiting or self._stopping:
                    return
                job = self._waiting[0]
            now = time.monotonic()
            if job.cancel.is_set():
                self._pop(job)
                continue
            if now - job.queued_at > self.limits.queue_timeout_s:
                self._pop(job)
                job.emit(Refused(503, f"the server was busy for {self.limits.queue_timeout_s:.0f} s; retry later",
                                 type="server_error", code="queue_timeout", retry_after=self.limits.retry_after_s))
                continue
            if self._start(job) == "wait":
                return
            self._pop(job)

    def _drop_cancelled(self) -> None:
        """Waiting requests whose clients left, wherever they are in the queue."""
        with self._cond:
            if any(job.cancel.is_set() for job in self._waiting):
                self._waiting = deque(job for job in self._waiting if not job.cancel.is_set())

    def _pop(self, job: ServeJob) -> None:
        with self._cond:
            if self._waiting and self._waiting[0] is job:
                self._waiting.popleft()

    def _start(self, job: ServeJob) -> str:
        session = self.session
        try:
            lane = self.streams.choose(job.policy, job.context)
        except LaneRefused as r:
            job.emit(Refused(r.status, r.message, type="server_error" if r.status >= 500 else "invalid_request_error",
                             code=r.code, param="localctx.kv", retry_after=r.retry_after))
            return "refused"
        except Exception as exc:  # noqa: BLE001 - lanes.py turns failures into LaneRefused; anything else is a bug
            log.exception("choosing a lane failed")
            job.emit(Refused(500, f"{session.backend_name} failed to open a lane: {exc}", type="server_error"))
            return "refused"
        try:
            params = self._fit(job, lane.plan)
            started = lane.streams.start(job.prompt, params, job.cancel, job.ids)
        except UserError as exc:
            job.emit(Refused(400, str(exc), code="context_length_exceeded" if "context" in str(exc) else None,
                             param="messages"))
            return "refused"
        except Exception as exc:  # noqa: BLE001 - the backend failed before anything was sent
            job.emit(Refused(500, f"{session.backend_name} failed: {exc}", type="server_error"))
            return "refused"
        if started is None:
            return "wait"
        stream, first = started
        self.streams.used(lane)
        job.lane = lane
        job.started_at = time.monotonic()
        if first is None:  # the source prefills it in its next steps, which send the first event
            self._live[id(stream)] = job
            return "started"
        if first.kind == "done":
            self.served += 1  # counted before the client can see its answer end
        else:
            self._live[id(stream)] = job
        job.emit(first)
        return "started"

    def _fit(self, job: ServeJob, lane_plan: Plan) -> GenerationParams:
        """Refuse a prompt that does not fit the request's context (never truncate it); cap the
        answer where that context ends."""
        if job.context is None:
            return job.params
        plan = dataclasses.replace(lane_plan, context=job.context)
        n = job.n_prompt if job.n_prompt is not None else self.session.count_tokens(job.prompt)
        check_prompt_fits(n, plan, self.session.spec, job.params.max_tokens)
        if plan.policy.evicts or job.params.max_tokens <= job.context - n:
            return job.params
        return dataclasses.replace(job.params, max_tokens=job.context - n)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for job in self._live.values():
            if job.started_at is not None and now - job.queued_at > job.timeout_s and not job.cancel.is_set():
                job.timed_out = True
                job.cancel.set()

    def _step(self) -> None:
        for lane in self.streams.busy_lanes():
            self._step_lane(lane)

    def _step_lane(self, lane: Lane) -> None:
        try:
            events = lane.streams.step()
        except Exception as exc:  # noqa: BLE001 - the source is broken: every stream of this lane fails
            log.exception("a %s step failed", self.session.backend_name)
            lane.streams.cancel_all()
            for key, job in list(self._live.items()):
                if job.lane is lane:
                    job.emit(Failed(f"{self.session.backend_name} failed mid-stream: {exc}"))
                    del self._live[key]
            return
        for stream, event in events:
            job = self._live.get(id(stream))
            if job is None:
                continue
            if isinstance(event, StreamFailed):
                del self._live[id(stream)]
                job.emit(Failed(f"{self.session.backend_name}: {event.message}"))
                continue
            if event.kind == "done":
                del self._live[id(stream)]
                self.served += 1  # counted before the client can see its answer end
            job.emit(event)
