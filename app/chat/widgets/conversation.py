"""The conversation pane: the user's messages, the answers as streamed markdown, and notes."""
from __future__ import annotations

from functools import lru_cache

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.geometry import Size
from textual.widget import Widget
from textual.widgets import Label, Markdown, Static
from textual.widgets.markdown import MarkdownBlock

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


SEAL_BLOCKS = 6  # a streaming answer's live piece holds at most this many closed blocks before they are sealed


class AnswerPiece(Markdown):
    """A run of top-level blocks of an answer. While the answer streams, each frame's text goes to its
    last piece (Textual's Markdown.append parses again only from the start of the block still open);
    once that piece holds more than SEAL_BLOCKS closed blocks, its open block moves to a new piece and
    the old one never changes again. Every frame's layout then re-arranges a piece of a few blocks,
    not every block of the answer so far: a frame costs the same at the end of a long answer as at
    its start."""

    def __init__(self, markdown: str = ""):
        super().__init__(markdown, parser_factory=markdown_parser)
        self.sealed = False
        self._sealed_height: tuple[int, int] | None = None  # (width, height) of the sealed blocks

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        """A sealed piece's height depends on the width only (its blocks are auto-height and never
        change), so it is measured once per width. Textual would arrange all its blocks again whenever
        the answer around it grows (it passes the answer's height down as the container's)."""
        if not self.sealed:
            return super().get_content_height(container, viewport, width)
        if self._sealed_height is None or self._sealed_height[0] != width:
            self._sealed_height = (width, super().get_content_height(container, viewport, width))
        return self._sealed_height[1]

    @property
    def blocks(self) -> list[MarkdownBlock]:
        return [child for child in self.children if isinstance(child, MarkdownBlock)]

    async def split_open_block(self) -> str:
        """Drops the last (still open) block and returns its source: the text a new piece starts from.
        Textual's append keeps every block before the open one as it is (they are closed), so this
        piece's blocks stay exactly what they were."""
        open_block = self.blocks[-1]
        lines = self.source.splitlines(keepends=True)
        start = open_block.source_range[0]
        self._markdown = "".join(lines[:start])  # Markdown.source: what the blocks left here show
        await open_block.remove()
        self.sealed = True
        return "".join(lines[start:])


class Answer(Vertical):
    """One assistant answer. While it streams, the screen appends a frame's text at a time to the live
    piece (AnswerPiece), which seals its closed blocks every SEAL_BLOCKS; when the answer ends,
    settle() draws it again as one Markdown, as a saved answer is drawn when a chat is opened."""

    def __init__(self, text: str = "", stats: TurnStats | None = None):
        super().__init__(classes="message assistant")
        self._initial = text
        self._stats = stats
        self.text = text

    def compose(self) -> ComposeResult:
        yield Label("assistant", classes="who")
        yield AnswerPiece(self._initial)
        yield Static(stats_line(self._stats) if self._stats else "", classes="stats")

    @property
    def pieces(self) -> list[AnswerPiece]:
        return list(self.query_children(AnswerPiece))

    @property
    def body(self) -> AnswerPiece:
        """The last piece: the whole answer once it has settled."""
        return self.pieces[-1]

    async def append(self, fragment: str) -> None:
        if not fragment:
            return
        self.text += fragment
        live = self.body
        await live.append(fragment)
        if len(live.blocks) > SEAL_BLOCKS + 1:  # the closed ones, plus the open one
            tail = await live.split_open_block()
            piece = AnswerPiece()
            await self.mount(piece, after=live)
            await piece.append(tail)  # not AnswerPiece(tail): update() would take the open block as closed

    async def settle(self) -> None:
        """One Markdown for the whole answer, as it is drawn when the chat is opened again."""
        pieces = self.pieces
        if len(pieces) > 1:
            with self.app.batch_update():
                await self.remove_children(pieces)
                await self.mount(AnswerPiece(self.text), after=self.query_one(".who"))

    async def finish(self, stats: TurnStats) -> None:
        self._stats = stats
        await self.settle()
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
