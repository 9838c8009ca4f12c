"""The chat app: one screen (ChatScreen) plus modal views; styles in chat.tcss."""
from __future__ import annotations

from textual.app import App

from localctx.app.chat.engine import ChatEngine
from localctx.app.chat.screens.chat_screen import ChatScreen
from localctx.app.chat.setup import ChatSetup


class ChatApp(App):
    CSS_PATH = "chat.tcss"
    TITLE = "localctx chat"

    def __init__(self, setup: ChatSetup):
        super().__init__()
        self.setup = setup
        self.engine = ChatEngine(setup.reopen, setup.params)
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
