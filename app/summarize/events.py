"""Progress for people (rich bars on stderr: documents and chunks, with tok/s) and for scripts
(``--json``: one JSON object per line on stdout)."""
from __future__ import annotations

import json
import sys
import time
from typing import IO


class Events:
    """The hooks the runner calls; the base class ignores them."""

    def start(self, documents: int, chunks: int, tokens: int, unchanged: int, skipped: int) -> None: ...
    def skipped(self, key: str, reason: str, ignored: bool) -> None: ...
    def unchanged(self, key: str) -> None: ...
    def doc_started(self, job) -> None: ...
    def call_done(self, request, result: dict, cached: bool, totals) -> None: ...
    def calls_added(self, n: int) -> None: ...
    def doc_done(self, job, record: dict) -> None: ...
    def finish(self, report: dict) -> None: ...
    def close(self) -> None: ...


class JsonEvents(Events):
    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream or sys.stdout

    def _emit(self, event: str, **fields) -> None:
        self.stream.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")
        self.stream.flush()

    def start(self, documents, chunks, tokens, unchanged, skipped):
        self._emit("start", documents=documents, chunks=chunks, input_tokens=tokens, unchanged=unchanged,
                   skipped=skipped)

    def skipped(self, key, reason, ignored):
        self._emit("ignored" if ignored else "skipped", path=key, reason=reason)

    def unchanged(self, key):
        self._emit("unchanged", path=key)

    def doc_started(self, job):
        self._emit("document_start", path=job.doc.key, chunks=len(job.chunks), input_tokens=job.input_tokens,
                   chunk_budget=job.budget.chunk)

    def call_done(self, request, result, cached, totals):
        t = totals.to_dict()
        self._emit("chunk_done", path=request.job.doc.key, step=request.step, level=request.level,
                   index=request.index, cached=cached, prompt_tokens=result.get("prompt_tokens", 0),
                   generated_tokens=result.get("generated_tokens", 0), finish_reason=result.get("finish_reason"),
                   input_tok_s=t["input_tok_s"])

    def doc_done(self, job, record):
        self._emit("document_done", **record)

    def finish(self, report):
        self._emit("done", exit_code=report["exit_code"], totals=report["totals"], counts=report["counts"],
                   report=report.get("report_path"))


class RichEvents(Events):
    """Two bars: documents, and chunk calls (the total grows as reductions are scheduled)."""

    def __init__(self, console=None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console or Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=self.console,
                                 transient=False)
        self.docs = self.progress.add_task("documents", total=0, rate="")
        self.calls = self.progress.add_task("chunks", total=0, rate="")
        self.progress.start()

    def start(self, documents, chunks, tokens, unchanged, skipped):
        self.progress.update(self.docs, total=documents)
        note = f"{documents} documents, {tokens:,} tokens in {chunks} chunks"
        if unchanged:
            note += f"; {unchanged} unchanged since the last run"
        if skipped:
            note += f"; {skipped} skipped (see the report)"
        self.progress.console.print(note)

    def skipped(self, key, reason, ignored):
        if not ignored:
            self.progress.advance(self.docs)
            self.progress.console.print(f"[yellow]skipped[/] {key}: {reason}")

    def unchanged(self, key):
        self.progress.advance(self.docs)

    def doc_started(self, job):
        self.calls_added(job.scheduled)

    def calls_added(self, n):
        self.progress.update(self.calls, total=(self.progress.tasks[self.calls].total or 0) + n)

    def call_done(self, request, result, cached, totals):
        t = totals.to_dict()
        self.progress.update(self.calls, advance=1,
                             rate=f"in {t['input_tok_s']:,.0f} tok/s, out "
                                  f"{t['generated_tokens'] / max(t['seconds'], 1e-9):,.0f} tok/s")

    def doc_done(self, job, record):
        self.progress.advance(self.docs)
        self.progress.update(self.docs, rate=job.doc.key)

    def finish(self, report):
        self.close()
        counts = report["counts"]
        empty = f", {counts['empty']} with no summary (the model answered nothing)" if counts["empty"] else ""
        self.console.print(f"{counts['done']} summarised, {counts['unchanged']} unchanged, {counts['skipped']} skipped"
                           f"{empty}; report: {report.get('report_path')}")

    def close(self):
        self.progress.stop()
