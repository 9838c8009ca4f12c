"""Shared helpers for the summarize tests: a fake session and a corpus made from pydoc topics."""
from __future__ import annotations

import io
import json
from pathlib import Path

from localctx.app.summarize.pipeline import BatchConfig, summarize
from localctx.app.summarize.events import JsonEvents
from localctx.app.summarize.jobs import Settings
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.backends.models.ref import resolve
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


def fake_session(context: int = 1024):
    return FakeBackend(delay=0).load(resolve("fake"), Plan.fixed("fake", FAKE_SPEC, KVPolicy(), context))


def topics_text(first: int, n: int) -> str:
    import pydoc_data.topics as topics
    keys = sorted(topics.topics)[first:first + n]
    return "\n\n".join(f"{k}\n{'*' * len(k)}\n\n{topics.topics[k]}" for k in keys)


def write_corpus(folder: Path) -> dict[str, str]:
    files = {"long.txt": topics_text(0, 30), "sub/medium.md": "# Medium\n\n" + topics_text(40, 4),
             "sub/short.rst": "Short\n=====\n\nA short note about caches.\n"}
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text, encoding="utf-8")
    return files


def run(paths, out: Path, session=None, **settings) -> tuple[dict, list[dict]]:
    session = session or fake_session()
    stream = io.StringIO()
    config = BatchConfig(paths=tuple(str(p) for p in paths), out_dir=out,
                         settings=Settings(**{"summary_tokens": 48, **settings}), model_id="fake")
    report = summarize(config, session, JsonEvents(stream))
    return report, [json.loads(line) for line in stream.getvalue().splitlines()]


def outputs(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.rglob("*.summary.md"))}
