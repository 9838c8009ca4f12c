"""The conversation pane: the user's messages, the answers as streamed markdown, and notes."""
from __future__ import annotations

from functools import lru_cache

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Label, Markdown, Static

from localctx.app.history import ChatMessage, Conversation, TurnStats

FINISH_WORDS = {"stop": "", "length": "hit the token limit", "cancelled": "stopped"}


def stats_line(stats: TurnStats) -> str:
    parts = [f"{stats.generated_tokens:,} tokens"]
    if stats.decode_tok_s:
        parts.append(f"decode {stats.decode_tok_s:,.1f} tok/s")
    if stats.tokens_per_step:
        parts.append(f"{stats.tokens_per_step:.2f} tokens/step (prompt lookup)")
    if stats.prefill_tok_s:
        parts.append(f"prefill {stats.prefill_tok_s:,.1f} tok/s")
    parts.append(f"{stats.prompt_tokens - stats.cached_tokens:,} of {stats.prompt_tokens:,} prompt tokens prefilled")
    if stats.shifted_tokens:
        parts.append(f"{stats.shifted_tokens:,} reused at moved positions (lossy)")
    if stats.evicted_tokens:
        parts.append(f"{stats.evicted_tokens:,} evicted")
    finish = FINISH_WORDS.get(stats.finish_reason, stats.finish_reason)
    if finish:
        parts.append(finish)
    return " · ".join(parts)


@lru_cache(maxsize=1)
def markdown_parser() -> MarkdownIt:
    """The parser Textual's Markdown uses by default, built once instead of once per append."""
    return MarkdownIt("gfm-like")


class UserMessage(Static):
    def __init__(self, text: str):
        super().__init__(text, markup=False, classes="message user")


class Note(Markdown):
    """Something the app says (help, errors, policy changes); never sent to the model."""

    def __init__(self, text: str, kind: str = "info"):
        super().__init__(text, classes=f"note {kind}")


class Answer(Vertical):
    """One assistant answer. While it streams, the screen appends a frame's text at a time; Textual's
    Markdown.append parses again only from the start of the last top-level block (the one still
    open) and keeps the blocks before it, so a frame costs the same at the end of a long answer as
    at its start."""

    def __init__(self, text: str = "", stats: TurnStats | None = None):
        super().__init__(classes="message assistant")
        self._initial = text
        self._stats = stats
        self.text = text

    def compose(self) -> ComposeResult:
        yield Label("assistant", classes="who")
        yield Markdown(self._initial, parser_factory=markdown_parser)
        yield Static(stats_line(self._stats) if self._stats else "", classes="stats")

    @property
    def body(self) -> Markdown:
        return self.query_one(Markdown)

    async def append(self, fragment: str) -> None:
        if not fragment:
            return
        self.text += fragment
        await self.body.append(fragment)

    async def finish(self, stats: TurnStats) -> None:
        self._stats = stats
        self.query_one(".stats", Static).update(stats_line(stats))


class ConversationView(VerticalScroll):
    def on_mount(self) -> None:
        self.anchor()

    async def show(self, conv: Conversation) -> None:
        await self.remove_children()
        widgets = []
        if conv.system:
            widgets.append(Note(f"**system prompt:** {conv.system}", "system"))
        widgets += [self._widget(m) for m in conv.messages]
        if widgets:
            await self.mount_all(widgets)
        self.scroll_end(animate=False)

    @staticmethod
    def _widget(message: ChatMessage):
        if message.role == "user":
            return UserMessage(message.content)
        return Answer(message.content, message.stats)

    async def add_user(self, text: str) -> None:
        await self.mount(UserMessage(text))

    async def start_answer(self) -> Answer:
        answer = Answer()
        await self.mount(answer)
        return answer

    async def add_note(self, text: str, kind: str = "info", before: Widget | None = None) -> None:
        """A note at the end of the conversation, or just ``before`` a widget of it."""
        await self.mount(Note(text, kind), before=before)
        self.scroll_end(animate=False)
