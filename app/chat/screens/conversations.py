"""The saved chats: pick one to switch to it; Delete removes the highlighted one."""
from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from localctx.app.history import ConversationSummary, History
from localctx.kvcache.errors import RuntimeFailure


def option_for(chat: ConversationSummary, current: int | None) -> Option:
    mark = "● " if chat.id == current else "  "
    noun = "message" if chat.n_messages == 1 else "messages"
    return Option(f"{mark}{chat.title}  ({chat.n_messages} {noun})", id=str(chat.id))


class ConversationsScreen(ModalScreen[int | None]):
    BINDINGS = [Binding("escape", "close", "Close"), Binding("delete", "delete", "Delete chat")]

    def __init__(self, chats: list[ConversationSummary], current: int | None, history: History):
        super().__init__()
        self.chats = chats
        self.current = current
        self.history = history

    def compose(self) -> ComposeResult:
        with Vertical(id="chats-box"):
            yield Label("Saved chats", classes="title")
            if self.chats:
                yield OptionList(*[option_for(c, self.current) for c in self.chats], id="chats")
            else:
                yield Label("No saved chats yet: what you send is saved as you go.", classes="hint")
            yield Label("Enter opens · Delete removes · Escape closes", classes="hint")

    @on(OptionList.OptionSelected)
    def chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_close(self) -> None:
        self.dismiss(None)

    def action_delete(self) -> None:
        options = self.query(OptionList)
        if not options or options.first().highlighted is None:
            return
        option_list = options.first()
        option = option_list.get_option_at_index(option_list.highlighted)
        chat_id = int(option.id)
        if chat_id == self.current:
            self.notify("That is the chat you are in: switch first (Ctrl+N) to delete it.", severity="warning")
            return
        try:
            self.history.delete(chat_id)
        except RuntimeFailure as exc:
            self.notify(str(exc), severity="error")
            return
        option_list.remove_option(option.id)
