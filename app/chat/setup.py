"""Everything the chat app is started with (the command builds it; tests build their own)."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.app.chat.chat_engine import Load, Reopen
from localctx.app.chat.worker_process import Opener
from localctx.app.history import History
from localctx.backends.base import GenerationParams
from localctx.kvcache.plan import Plan


@dataclass
class ChatSetup:
    load: Load  # loads the planned model: runs in a worker while the UI is already up
    plan: Plan  # what load() runs (a bad model or policy is refused before the TUI starts)
    model: str  # the model's name, shown while it loads
    reopen: Reopen  # a new session with another KV policy, for /kv
    history: History
    params: GenerationParams = GenerationParams(max_tokens=1024, speculate="auto")
    hardware: str = ""  # shown when the plan does not name the hardware
    system: str = ""  # system prompt of new chats
    resume: bool = False  # open the most recent saved chat instead of a new one
    notice: str | None = None  # said once at start (e.g. a corrupt history moved aside)
    # the model in a child process that opens this (app/chat/worker_process.py); None: in this
    # process, through load and reopen (a remote session, whose server does the work; tests' scripted sessions)
    opener: Opener | None = None
