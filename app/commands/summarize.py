"""``localctx summarize``: offline batch summarisation of documents of any length."""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from localctx.app.session_options import (SessionRequest, add_prompt_cache_option, add_session_options, open_session,
                                          resolve_model)
from localctx.app.summarize.pipeline import EXIT_SOME_EMPTY, EXIT_SOME_SKIPPED, BatchConfig, summarize
from localctx.app.summarize.events import JsonEvents, RichEvents
from localctx.app.summarize.jobs import Settings
from localctx.app.summarize.store import META_DIR, REPORT_NAME, SUMMARY_SUFFIX
from localctx.kvcache.errors import UserError

EPILOG = f"""\
Output: DIR/<path>{SUMMARY_SUFFIX} for each input (folders are mirrored), DIR/{REPORT_NAME} (every
input with its status, tokens, chunks, reduction depth), and DIR/{META_DIR}/ (the manifest and a
cache of every generation). A rerun skips documents whose bytes, model, KV policy, prompts and
settings are unchanged, and reuses cached chunk summaries, so an interrupted run (even kill -9)
loses at most the generations in flight.

Long documents are never truncated: they are cut on headings, then paragraphs, then sentences
into chunks that fit the context with the prompt and the answer, summarised, and the summaries
summarised again until one is left (map-reduce), or folded into a running summary (refine).

Exit codes:
  0    every document was summarised (or was unchanged since the last run)
  {EXIT_SOME_SKIPPED}    the batch finished, but some inputs were skipped as bad (binary, empty,
       undecodable, unreadable, unsupported): the report says which and why
  {EXIT_SOME_EMPTY}    the batch finished, but the model answered nothing for some documents (no
       summary written for them; a later run tries them again): the report says which
  2    a usage error (no inputs, bad option, context too small); nothing was run
  1    the model or backend failed; finished summaries are kept, rerun to resume
  130  interrupted; rerun to resume
"""


def register(sub) -> None:
    p = sub.add_parser("summarize", help="summarise documents of any length, in batch, resumably",
                       description="Summarise each file (.txt .md .rst .html .pdf; folders recursively) "
                                   "into DIR, whatever its length.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH", help="files and folders to summarise")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the summaries and the report")
    add_session_options(p)
    add_prompt_cache_option(p)
    p.add_argument("--mode", choices=("map-reduce", "refine"), default="map-reduce",
                   help="map-reduce (default: chunks summarised in parallel, then combined) or refine "
                        "(a running summary extended chunk by chunk)")
    p.add_argument("--summary-tokens", type=int, default=256, metavar="N",
                   help="most tokens per generated summary (default 256)")
    p.add_argument("--chunk-tokens", type=int, default=None, metavar="N",
                   help="document tokens per chunk (default: a quarter of the context less the prompt and answer)")
    p.add_argument("--batch", type=int, default=8, metavar="N",
                   help="most chunks decoded together on batching backends (default 8; "
                        "the context budget may allow fewer)")
    p.add_argument("--json", action="store_true", help="progress as JSON lines on stdout instead of bars")
    p.set_defaults(handler=handle)


def settings_from(args: argparse.Namespace) -> Settings:
    if args.summary_tokens < 16:
        raise UserError(f"--summary-tokens {args.summary_tokens} is too small; give at least 16")
    if args.batch < 1:
        raise UserError(f"--batch {args.batch} must be at least 1")
    return Settings(mode=args.mode, summary_tokens=args.summary_tokens, chunk_tokens=args.chunk_tokens,
                    max_batch=args.batch)


def model_id(req: SessionRequest) -> str:
    ref, _spec = resolve_model(req)
    if ref.kind == "fake":
        return "fake"
    try:
        size = ref.path.stat().st_size if ref.path.is_file() else 0
    except OSError:
        size = 0
    return f"{ref.name}:{ref.path.name}:{size}"


def remote_settings(settings: Settings, session) -> Settings:
    """With --backend openai, as many chunks are in flight as the endpoints have slots (up to --batch)."""
    from localctx.backends.openai.session import RemoteSession

    if not isinstance(session, RemoteSession):
        return settings
    return replace(settings, batch_tokens=session.plan.context * max(1, session.total_slots))


def handle(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    out_dir = Path(args.out).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {args.out} is a file; give a folder")
    missing = [p for p in args.paths if not Path(p).expanduser().exists()]
    if missing:  # before loading a model
        raise UserError(f"input not found: {', '.join(missing)}; give existing files or folders")
    req = SessionRequest.from_args(args, prompt_cache=args.prompt_cache)
    config = BatchConfig(paths=tuple(args.paths), out_dir=out_dir, settings=settings, model_id=model_id(req))
    events = JsonEvents() if args.json else RichEvents()
    try:
        with open_session(req) as session:
            config = replace(config, settings=remote_settings(settings, session))
            report = summarize(config, session, events)
    finally:
        events.close()
    return report["exit_code"]
