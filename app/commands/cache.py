"""``localctx cache ls|rm|clear``: the prompt cache on disk (kvcache/prompt_cache.py)."""
from __future__ import annotations

import argparse
import json
import time

from localctx.kvcache import prompt_cache
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("cache", help="list or remove the KV of long prompts kept on disk",
                       description="The prompt cache: run, chat and summarize keep the KV of prompts of "
                                   f"{prompt_cache.MIN_TOKENS}+ tokens on disk and reuse it for prompts that start "
                                   f"the same way. Disk use is capped at ${prompt_cache.BUDGET_ENV} bytes "
                                   f"(default {format_bytes(prompt_cache.DEFAULT_BUDGET)}), least recently used "
                                   "first out.")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="ls|rm|clear")
    ls = verbs.add_parser("ls", help="list the cached prompts, most recently used first")
    ls.add_argument("--json", action="store_true")
    rm = verbs.add_parser("rm", help="remove cached prompts by name (as ls shows it)")
    rm.add_argument("names", nargs="+")
    verbs.add_parser("clear", help="remove every cached prompt")
    p.set_defaults(handler=handle)


def row(e: prompt_cache.Entry) -> dict:
    m = e.meta
    return {"name": e.name, "path": str(e.path), "bytes": e.size, "tokens": int(m.get("n_tokens", 0) or 0),
            "backend": m.get("scope_backend", "?"), "policy": m.get("scope_policy", "?"),
            "model_sha256": m.get("scope_model_hash", "?"),
            "last_used": time.strftime("%Y-%m-%d %H:%M", time.localtime(e.used))}


def handle(args: argparse.Namespace) -> int:
    entries = prompt_cache.entries()
    if args.verb == "ls":
        rows = [row(e) for e in entries]
        if args.json:
            print(json.dumps({"root": str(prompt_cache.root()), "total_bytes": sum(e.size for e in entries),
                              "entries": rows}))
            return 0
        print(f"{len(rows)} cached prompts, {format_bytes(sum(e.size for e in entries))} in {prompt_cache.root()}")
        for r in rows:
            print(f"  {r['name']}  {r['tokens']:>7,} tokens  {format_bytes(r['bytes']):>10}  {r['backend']:<8} "
                  f"{r['policy']:<18} model {r['model_sha256'][:12]}  used {r['last_used']}")
        return 0
    if args.verb == "clear":
        for e in entries:
            e.path.unlink(missing_ok=True)
        print(f"removed {len(entries)} cached prompts ({format_bytes(sum(e.size for e in entries))})")
        return 0
    by_name = {e.name: e for e in entries}
    missing = [n for n in args.names if n not in by_name]
    if missing:
        raise UserError(f"no cached prompt named {', '.join(missing)}; see localctx cache ls")
    for name in args.names:
        by_name[name].path.unlink(missing_ok=True)
    print(f"removed {len(args.names)} cached prompts")
    return 0
