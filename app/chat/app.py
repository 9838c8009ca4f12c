"""The chat app: one screen (ChatScreen) plus modal views; styles in chat.tcss."""
from __future__ import annotations

import gc
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
