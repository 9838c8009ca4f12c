"""``localctx chat``: the Textual chat that shows what the KV cache is doing."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import replace

import psutil

from localctx.app.session_options import (GROW_FROM_TOKENS, SessionRequest, add_cache_reuse_option,
                                          add_prompt_cache_option, add_session_options, calibration_offer,
                                          open_session, plan_session)
from localctx.backends.generation import speculation
from localctx.backends.base import GenerationParams
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat in the terminal, with the KV cache in view",
                       description="Chat with a local model. Enter sends, Escape stops, Ctrl+N starts a new "
                                   "chat, Ctrl+O lists saved chats, F2 shows the plan, /help lists commands.")
    add_session_options(p)
    add_prompt_cache_option(p)
    add_cache_reuse_option(p)
    p.add_argument("--system", default="", help="system prompt for new chats")
    p.add_argument("--max-tokens", type=int, default=1024, help="most tokens per answer (default 1024)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--speculate", default="auto", choices=speculation.MODES,
                   help="prompt-lookup drafts: auto (default), ngram, off")
    p.add_argument("--resume", action="store_true", help="open the most recent saved chat")
    p.set_defaults(handler=handle)


def describe_hardware() -> str:
    memory = format_bytes(psutil.virtual_memory().total)
    return f"{platform.machine() or 'cpu'}, {os.cpu_count() or 1} cores, {memory} RAM"


def params_from(args: argparse.Namespace) -> GenerationParams:
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens {args.max_tokens} must be at least 1")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature} must be 0 (greedy) or more")
    return GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, speculate=args.speculate)


def handle(args: argparse.Namespace) -> int:
    # imported here so that other commands do not pay for Textual
    from localctx.app.chat.app import ChatApp
    from localctx.app.chat.setup import ChatSetup
    from localctx.app.chat.worker_process import Opener
    from localctx.app.history import History

    params = params_from(args)
    request = replace(SessionRequest.from_args(args, prompt_cache=args.prompt_cache, cache_reuse=args.cache_reuse),
                      allocate=GROW_FROM_TOKENS)  # the KV starts small and grows with the conversation
    planned = plan_session(request)  # a bad -m / --kv / --context fails here, before the TUI starts
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UserError("localctx chat needs a terminal (stdin and stdout); for piped or scripted use, "
                        'run localctx run "PROMPT"')
    offer = calibration_offer(planned)
    if offer:
        print(offer, file=sys.stderr)
    history, notice = History.open()
    setup = ChatSetup(load=planned.load, plan=planned.plan, model=planned.spec.name,
                      reopen=lambda kv: open_session(replace(request, kv=kv)), history=history, params=params,
                      hardware=describe_hardware(), system=args.system, resume=args.resume, notice=notice,
                      # a local model decodes in a child process; a remote one is only an HTTP client
                      opener=Opener(planned, request) if planned.opened is None else None)
    app = ChatApp(setup)  # the model loads in a child process while the screen comes up
    try:
        app.run()
    finally:
        app.engine.close()
        history.close()
    if app.load_error is not None:
        raise app.load_error
    return app.return_code or 0
