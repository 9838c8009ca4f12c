"""Many independent requests spread over several endpoints (``generate_batch`` of the openai
backend; ``localctx summarize`` runs through it).

Each endpoint gets as many requests at once as it has free slots (localctx serve reports them
on /health; another server gets its nominal slots). A request that meets a connection error,
a timeout or a 5xx goes back to the shared queue, after a backoff, for whichever endpoint is
free next; an endpoint that fails ``DEAD_AFTER`` times in a row is dropped for the rest of the
call, and its in-flight requests are sent elsewhere. Each index is yielded done exactly once
(a late duplicate answer is discarded), so a caller's manifest stays exact."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from localctx.backends.base import GenerationEvent, GenerationParams, Prompt
from localctx.backends.openai.client import EndpointDown, RequestRefused
from localctx.kvcache.errors import RuntimeFailure, UserError

if TYPE_CHECKING:
    from localctx.backends.openai.session import Endpoint, RemoteSession

DEAD_AFTER = 3  # consecutive failures before an endpoint is dropped
MAX_ATTEMPTS = 8  # tries per request, over all endpoints
BACKOFF_S = 0.25  # first retry delay; doubles per consecutive failure of the endpoint, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 8.0


@dataclass
class _Task:
    index: int
    path: str
    body: dict
    attempts: int = 0


@dataclass(frozen=True)
class _Result:
    index: int
    answer: dict | None = None
    error: Exception | None = None
    endpoint: str = ""


class _Spread:
    def __init__(self, session: "RemoteSession", prompts: list[Prompt], params: GenerationParams,
                 cancel: threading.Event | None):
        self.session = session
        self.cancel = cancel or threading.Event()
        self.tasks: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.open = len(prompts)  # indexes not yet answered
        self.lock = threading.Lock()
        self.stop = threading.Event()
        for i, prompt in enumerate(prompts):
            path, body = session.body(prompt, params, stream=False)
            self.tasks.put(_Task(i, path, body))
        self.workers: list[threading.Thread] = []

    def start(self) -> None:
        for endpoint in self.session.alive():
            n = max(1, min(endpoint.free_slots() or 1, endpoint.slots, self.open))
            for k in range(n):
                t = threading.Thread(target=self._work, args=(endpoint,), daemon=True,
                                     name=f"localctx-remote-{endpoint.url}-{k}")
                t.start()
                self.workers.append(t)

    def _work(self, endpoint: "Endpoint") -> None:
        while not self.stop.is_set() and not endpoint.dead:
            try:
                task = self.tasks.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                answer = endpoint.client.post(task.path, task.body)
            except EndpointDown as exc:
                self._failed(endpoint, task, exc)
                continue
            except RequestRefused as exc:
                self.results.put(_Result(task.index, error=exc, endpoint=endpoint.url))
                continue
            endpoint.failures = 0
            self.results.put(_Result(task.index, answer=answer, endpoint=endpoint.url))

    def _failed(self, endpoint: "Endpoint", task: _Task, exc: EndpointDown) -> None:
        task.attempts += 1
        with self.lock:
            endpoint.failures += 1
            if endpoint.failures >= DEAD_AFTER:
                endpoint.dead = True
            delay = exc.retry_after or min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (endpoint.failures - 1))
        if task.attempts >= MAX_ATTEMPTS:
            self.results.put(_Result(task.index, error=RuntimeFailure(
                f"request {task.index + 1} failed {task.attempts} times; last: {exc}"), endpoint=endpoint.url))
            return
        self.tasks.put(task)  # back in the shared queue: any live endpoint may take it
        if not self.session.alive():
            self.results.put(_Result(-1, error=RuntimeFailure(
                "every endpoint failed: " + ", ".join(e.url for e in self.session.endpoints) + f"; last: {exc}")))
            return
        self.stop.wait(delay)

    def events(self) -> Iterator[tuple[int, GenerationEvent]]:
        answered: set[int] = set()
        try:
            while len(answered) < self.open:
                if self.cancel.is_set():
                    return
                try:
                    result = self.results.get(timeout=0.2)
                except queue.Empty:
                    continue
                if result.error is not None:
                    if isinstance(result.error, RequestRefused):
                        raise UserError(f"the server refused request {result.index + 1}: {result.error}")
                    raise result.error
                if result.index in answered:
                    continue  # answered already (a resent request that finished twice)
                answered.add(result.index)
                yield from self._answer(result)
        finally:
            self.stop.set()

    def _answer(self, result: _Result) -> Iterator[tuple[int, GenerationEvent]]:
        answer = result.answer or {}
        choice = (answer.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
        stats = self.session.whole_answer_stats(answer.get("usage"), answer.get("localctx"))
        if text:
            yield result.index, GenerationEvent("token", stats, text=text)
        yield result.index, GenerationEvent("done", stats, finish_reason=choice.get("finish_reason") or "stop")


def run_spread(session: "RemoteSession", prompts: list[Prompt], params: GenerationParams,
               cancel: threading.Event | None) -> Iterator[tuple[int, GenerationEvent]]:
    if not prompts:
        return iter(())
    spread = _Spread(session, prompts, params, cancel)
    spread.start()
    return spread.events()
