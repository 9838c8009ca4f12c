"""Everything the chat app is started with (the command builds it; tests build their own)."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.app.chat.engine import Reopen
from localctx.app.history import History
from localctx.backends.base import GenerationParams, Session


@dataclass
class ChatSetup:
    session: Session  # already loaded: a bad model is a one-line error before the TUI starts
    reopen: Reopen  # a new session with another KV policy, for /kv
    history: History
    params: GenerationParams = GenerationParams(max_tokens=1024, speculate="auto")
    hardware: str = ""  # shown when the plan does not name the hardware
    system: str = ""  # system prompt of new chats
    resume: bool = False  # open the most recent saved chat instead of a new one
    notice: str | None = None  # said once at start (e.g. a corrupt history moved aside)
