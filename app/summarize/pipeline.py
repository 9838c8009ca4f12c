"""The whole ``localctx summarize`` run: find inputs, skip bad and unchanged ones, run the rest,
write the JSON report. Returns the report (with the exit code in it)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from localctx.app.summarize.events import Events
from localctx.app.summarize.inputs import Skipped, discover, read
from localctx.app.summarize.jobs import Settings
from localctx.app.summarize.prompts import load_prompts
from localctx.app.summarize.executor import Runner
from localctx.app.summarize.store import REPORT_NAME, Store, atomic_write
from localctx.backends.base import Session
from localctx.kvcache.errors import UserError

EXIT_OK = 0
EXIT_SOME_SKIPPED = 3  # every readable document was summarised, but some inputs were bad (see the report)
EXIT_SOME_EMPTY = 4  # the batch finished, but the model answered nothing for some documents (see the report)


@dataclass(frozen=True)
class BatchConfig:
    paths: tuple[str, ...]
    out_dir: Path
    settings: Settings
    model_id: str  # names the weights: goes into cache keys and the manifest


def summarize(config: BatchConfig, session: Session, events: Events) -> dict:
    started = time.time()
    files, ignored = discover(list(config.paths), config.out_dir)
    if not files:
        found = f" (found only unsupported files: {', '.join(s.key for s in ignored[:5])})" if ignored else ""
        raise UserError(f"no documents to summarise in {', '.join(config.paths)}{found}; "
                        "give .txt, .md, .rst, .html or .pdf files or folders holding them")
    store = Store(config.out_dir)
    prompts = load_prompts()
    identity = {"model": config.model_id, "backend": session.plan.backend, "policy": str(session.plan.policy)}
    runner = Runner(session, store, prompts, config.settings, events, identity)
    records: list[dict] = []
    for item in ignored:
        events.skipped(item.key, item.reason, ignored=True)
        records.append({"path": item.key, "status": "ignored", "reason": item.reason})
    jobs = []
    for item in files:
        doc = read(item)
        if isinstance(doc, Skipped):
            events.skipped(doc.key, doc.reason, ignored=False)
            records.append({"path": doc.key, "status": "skipped", "reason": doc.reason})
        elif store.is_done(doc.key, runner.fingerprint(doc)):
            events.unchanged(doc.key)
            records.append({"path": doc.key, "status": "unchanged", "output": str(store.summary_path(doc.key))})
        else:
            jobs.append(runner.prepare(doc))
    n_skipped = sum(1 for r in records if r["status"] == "skipped")
    n_unchanged = sum(1 for r in records if r["status"] == "unchanged")
    events.start(documents=len(files), chunks=sum(len(j.chunks) for j in jobs),
                 tokens=sum(j.input_tokens for j in jobs), unchanged=n_unchanged, skipped=n_skipped)
    report: dict = {}
    try:
        runner.run(jobs)
    finally:
        finished = {r["path"] for r in runner.records}
        unfinished = [{"path": j.doc.key, "status": "interrupted"} for j in jobs if j.doc.key not in finished]
        all_records = sorted(records + runner.records + unfinished, key=lambda r: r["path"])
        counts = {s: sum(1 for r in all_records if r["status"] == s)
                  for s in ("done", "unchanged", "skipped", "ignored", "empty", "interrupted")}
        report = {
            "command": "summarize", "inputs": list(config.paths), "out": str(config.out_dir),
            "model": config.model_id, "backend": session.plan.backend, "policy": str(session.plan.policy),
            "exact": session.plan.exact, "context": session.plan.context, "mode": config.settings.mode,
            "summary_tokens": config.settings.summary_tokens, "chunk_tokens": config.settings.chunk_tokens,
            "max_batch": config.settings.max_batch, "prompt_version": prompts.version,
            "started": round(started, 3), "finished": round(time.time(), 3),
            "counts": counts, "totals": runner.totals.to_dict(), "documents": all_records,
            "exit_code": EXIT_SOME_EMPTY if counts["empty"] else EXIT_SOME_SKIPPED if counts["skipped"] else EXIT_OK,
            "report_path": str(config.out_dir / REPORT_NAME),
        }
        atomic_write(config.out_dir / REPORT_NAME, json.dumps(report, indent=1))
    events.finish(report)
    return report
