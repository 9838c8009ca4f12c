"""The chat app: one screen (ChatScreen) plus modal views; styles in chat.tcss."""
from __future__ import annotations

import gc
import os
import sys

from textual.app import App

from localctx.app.chat.chat_engine import ChatEngine
from localctx.app.chat.screens.chat_screen import ChatScreen
from localctx.app.chat.setup import ChatSetup
from localctx.app.chat.worker_process import ProcessEngine


# How long a thread may hold the GIL while another waits for it (for a model in this process: a
# remote session, or a scripted one in tests; `localctx chat` decodes in a child process). Python's 5 ms default lets the UI's
# event loop keep the decode thread waiting up to 5 ms after each llama.cpp call returns (a token
# takes ~13 ms at 76 tok/s); 0.5 ms hands it back at once (docs/benchmarks.md, "The chat against
# `localctx run`").
GIL_SWITCH_INTERVAL_S = 0.0005


# The scheduling priority the UI process gives up once the model decodes in its own process
# (worker_process.py): llama.cpp's threads use every core and spin-wait for each other, so a core the UI
# takes while an answer streams stalls them all. Under Linux's default scheduler, nice 10 gives the decoder
# the cores first and the UI the gaps: on 2 cores the chat decoded at 0.87x `localctx run` and now at
# ~0.96x, while keys still echo at once (docs/benchmarks.md, "The chat against `localctx run`").
UI_NICE = 10


def yield_to_model(increment: int = UI_NICE) -> None:
    """Lowers this thread's priority (and that of the threads it starts later: Textual's) by ``increment``.
    `localctx chat` calls it once its model process has started (a child inherits its parent's priority)
    and before the app runs. No-op where the OS has no nice values; a refusal is ignored."""
    if os.name != "posix" or increment <= 0:
        return
    try:
        os.nice(increment)
    except OSError:
        pass


def freeze_startup_objects() -> None:
    """Moves everything alive once the screen is drawn (imports, the widget tree, styles: ~100,000
    objects) out of the garbage collector's reach. A full collection while an answer streams then
    walks only what was made since, and the UI thread's CPU per answer drops with it (a 500-token answer:
    ~33 ms of collections down to ~10 ms, CPU the decoder's threads get back on a 2-core machine;
    docs/benchmarks.md, "The chat against `localctx run`"). What was frozen is handed back on unmount."""
    gc.freeze()


class ChatApp(App):
    CSS_PATH = "chat.tcss"
    TITLE = "localctx chat"

    def on_mount(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        if isinstance(self.engine, ChatEngine):  # with the model in a child, no thread here decodes
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.call_after_refresh(freeze_startup_objects)

    def on_unmount(self) -> None:
        sys.setswitchinterval(self._switch_interval)
        gc.unfreeze()

    def __init__(self, setup: ChatSetup):
        super().__init__()
        self.setup = setup
        self.engine = ProcessEngine(setup.opener, setup.params) if setup.opener is not None else \
            ChatEngine(setup.reopen, setup.params)
        self.load_error: Exception | None = None  # the model could not be loaded: the command reports it
        self.chat: ChatScreen | None = None

    def get_default_screen(self) -> ChatScreen:
        self.chat = ChatScreen(self.setup, self.engine)
        return self.chat

    async def action_quit(self) -> None:
        if self.chat is not None:
            self.chat.save_partial()
        self.engine.stop()
        self.exit()
