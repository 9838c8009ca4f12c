"""Runs every document's jobs over one session: requests from several documents are decoded
together through ``Session.generate_batch`` (as many as fit the plan's context budget, at most
--batch), cached generations are reused, finished summaries are written as they complete."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

from localctx.app.summarize.events import Events
from localctx.app.summarize.inputs import Document
from localctx.app.summarize.jobs import Job, Request, Settings, make_job
from localctx.app.summarize.prompts import PromptSet
from localctx.app.summarize.store import Store, request_key
from localctx.backends.base import GenerationParams, Session
from localctx.kvcache.errors import RuntimeFailure


@dataclass
class Totals:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    covered_tokens: int = 0  # document tokens read by chunk-level calls (cached ones included)
    calls: int = 0
    cached_calls: int = 0
    batches: int = 0
    widest_batch: int = 0
    started: float = field(default_factory=time.perf_counter)

    def to_dict(self) -> dict:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "covered_tokens": self.covered_tokens, "calls": self.calls, "cached_calls": self.cached_calls,
                "batches": self.batches, "widest_batch": self.widest_batch, "seconds": round(elapsed, 3),
                "input_tok_s": round(self.covered_tokens / elapsed, 2)}


# what the report and the command say of a document whose summary came out empty
EMPTY_REASON = ("the model answered nothing (a base model without a chat template often starts a new question "
                "at once); no summary written: try an instruct model")


class Runner:
    def __init__(self, session: Session, store: Store, prompts: PromptSet, settings: Settings, events: Events,
                 identity: dict):
        self.session = session
        self.store = store
        self.prompts = prompts
        self.settings = settings
        self.events = events
        self.identity = identity  # model, backend, policy: goes into every cache key and fingerprint
        self.params = GenerationParams(max_tokens=settings.summary_tokens, temperature=0.0, speculate="auto")
        self.totals = Totals()
        self.records: list[dict] = []

    def fingerprint(self, doc: Document) -> dict:
        return {"sha256": doc.sha256, "prompt_version": self.prompts.version, "mode": self.settings.mode,
                "summary_tokens": self.settings.summary_tokens, "chunk_tokens": self.settings.chunk_tokens,
                "context": self.session.plan.context, **self.identity}

    def prepare(self, doc: Document) -> Job:
        return make_job(doc, self.settings, self.prompts, self.session.count_tokens, self.session.plan.context)

    def run(self, jobs: Iterable[Job]) -> None:
        pending = list(jobs)
        active: list[Job] = []
        while pending or active:
            while pending and sum(len(j.queue) for j in active) < self.settings.max_batch:
                job = pending.pop(0)
                active.append(job)
                self.events.doc_started(job)
            self._resolve_cached(active)
            batch = self._pick_batch(active)
            if batch:
                self._generate(batch)
            for job in [j for j in active if j.done]:
                active.remove(job)
                self._finish(job)

    def _key(self, request: Request) -> str:
        return request_key({"messages": request.messages, "max_tokens": self.params.max_tokens, **self.identity})

    def _resolve_cached(self, active: list[Job]) -> None:
        progress = True
        while progress:
            progress = False
            for job in active:
                for request in list(job.queue):
                    hit = self.store.cached(self._key(request))
                    if hit is None:
                        continue
                    job.queue.remove(request)
                    self.totals.cached_calls += 1
                    self._account(request, hit, cached=True)
                    self._deliver(request, hit["text"], hit.get("finish_reason", "stop"))
                    progress = True

    def _pick_batch(self, active: list[Job]) -> list[tuple[Request, int]]:
        """Oldest documents first, as many requests as fit the context budget together."""
        batch, used = [], 0
        room = self.settings.batch_tokens or self.session.plan.context  # several endpoints hold more
        for job in active:
            for request in job.queue:
                if request.prompt_tokens is None:
                    request.prompt_tokens = self.session.count_tokens(request.messages)
                n = request.prompt_tokens
                need = n + self.params.max_tokens
                if need > self.session.plan.context:
                    raise RuntimeFailure(f"{job.doc.key}: a {request.step} prompt of {n} tokens does not fit the "
                                         f"context of {self.session.plan.context} (chunking bug)")
                if batch and (used + need > room or len(batch) >= self.settings.max_batch):
                    return batch
                batch.append((request, n))
                used += need
        return batch

    def _generate(self, batch: list[tuple[Request, int]]) -> None:
        requests = [r for r, _n in batch]
        for request in requests:
            request.job.queue.remove(request)
        texts = [[] for _ in requests]
        self.totals.batches += 1
        self.totals.widest_batch = max(self.totals.widest_batch, len(requests))
        for index, event in self.session.generate_batch([r.messages for r in requests], self.params):
            if event.text:
                texts[index].append(event.text)
            if event.kind != "done":
                continue
            request = requests[index]
            result = {"text": "".join(texts[index]), "finish_reason": event.finish_reason,
                      "prompt_tokens": event.stats.prompt_tokens, "generated_tokens": event.stats.generated_tokens}
            self.store.remember(self._key(request), result)
            self._account(request, result, cached=False)
            self._deliver(request, result["text"], event.finish_reason or "stop")

    def _deliver(self, request: Request, text: str, finish_reason: str) -> None:
        job = request.job
        before = job.scheduled
        job.deliver(request, text, finish_reason)
        if job.scheduled > before:
            self.events.calls_added(job.scheduled - before)

    def _account(self, request: Request, result: dict, cached: bool) -> None:
        self.totals.calls += 1
        self.totals.covered_tokens += request.covers
        if not cached:
            self.totals.prompt_tokens += int(result.get("prompt_tokens", 0))
            self.totals.generated_tokens += int(result.get("generated_tokens", 0))
        self.events.call_done(request, result, cached, self.totals)

    def _finish(self, job: Job) -> None:
        record = {"path": job.doc.key, "status": "done", "input_tokens": job.input_tokens,
                  "characters": len(job.doc.text), "chunks": len(job.chunks), "chunk_budget": job.budget.chunk,
                  "depth": job.depth, "calls": job.calls, "answers_at_token_limit": job.truncated_answers,
                  "empty_answers": job.empty_answers}
        if not (job.result or "").strip():  # no file, and not in the manifest: a later run tries it again
            record.update(status="empty", reason=EMPTY_REASON)
        else:
            record["output"] = str(self.store.finish(job.doc.key, self.fingerprint(job.doc), job.result, record))
        self.records.append(record)
        self.events.doc_done(job, record)
