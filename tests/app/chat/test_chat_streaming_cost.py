"""What a streaming answer costs the UI thread, counted as work done (never as time): a frame at the
end of a long answer arranges as many markdown blocks as a frame at its start; the side panel's
figures repaint without a layout; the input's cursor does not blink while an answer streams."""
from __future__ import annotations

import asyncio
import threading

from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Static
from textual.widgets.markdown import MarkdownBlock

from localctx.app.chat import frames
from localctx.app.chat.screens.chat_screen import ChatScreen
from localctx.app.chat.widgets import conversation
from localctx.app.chat.widgets.cache_panel import CachePanel
from localctx.app.chat.widgets.conversation import Answer
from localctx.backends.base import GenerationEvent, GenerationParams

from chat_helpers import SIZE, GatedSession, fake_session, make_app, send, wait_until
from test_chat_frames import PARAGRAPH, TOKENS, StorySession, story_tokens


class SteppedSession(StorySession):
    """Streams story_tokens() one paragraph per step, each step when the test releases it: every
    frame then carries one paragraph, however loaded the machine is."""

    def __init__(self):
        super().__init__()
        self.steps = threading.Semaphore(0)

    def generate(self, prompt, params: GenerationParams = GenerationParams(), cancel: threading.Event | None = None):
        tokens = story_tokens()
        for i, text in enumerate(tokens):
            if i % PARAGRAPH == 0:
                self.steps.acquire(timeout=30)
            yield GenerationEvent("token", self.stats(i + 1), text=text, token=i)
        yield GenerationEvent("done", self.stats(len(tokens)), finish_reason="stop")


def test_a_frame_arranges_as_many_blocks_at_the_end_of_a_long_answer_as_at_its_start(history, monkeypatch):
    """Textual arranges every child of a container whose height changed; an answer growing in one
    Markdown had all its blocks measured again in every frame. Sealed pieces are measured once."""
    measured: list[int] = [0]  # blocks whose height was computed, per frame (a new entry when a frame is drawn)
    real_height, real_draw = Widget.get_content_height, ChatScreen.draw_frame

    def counting_height(self, container, viewport, width):
        if isinstance(self, MarkdownBlock):
            measured[-1] += 1
        return real_height(self, container, viewport, width)

    async def counting_draw(self):
        measured.append(0)
        await real_draw(self)

    monkeypatch.setattr(Widget, "get_content_height", counting_height)
    monkeypatch.setattr(ChatScreen, "draw_frame", counting_draw)
    # the test releases each frame's paragraph itself, so the pacer need not space frames by their cost
    # (its 2-second ceiling, reached by a slow test host's frames, made this test take 50 of them)
    monkeypatch.setattr(frames, "MAX_INTERVAL", frames.FRAME_INTERVAL)
    session = SteppedSession()
    app = make_app(history, session)

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            await send(pilot, "tell me a long story")
            for _ in range(TOKENS // PARAGRAPH):
                drawn = chat.frames_drawn
                session.steps.release()
                await wait_until(pilot, lambda: chat.frames_drawn > drawn and not chat.frames.finished, timeout=30)
                await pilot.pause(0.05)  # its layouts
            await wait_until(pilot, lambda: chat.turn == 1 and not chat.busy, timeout=30)

    asyncio.run(go())
    streaming = measured[1:-1]  # the frames of the answer, less the last one (it draws the settled answer)
    assert len(streaming) >= TOKENS // PARAGRAPH - 2
    early, late = streaming[:len(streaming) // 2], streaming[len(streaming) // 2:]
    # a frame measures the live piece's blocks (at most SEAL_BLOCKS + 1, plus the new one) in its
    # layouts, whatever came before; early frames also measure once what the first overflow re-wraps
    assert max(late) <= max(early), streaming
    bound = 3 * (conversation.SEAL_BLOCKS + 3)
    assert max(late) <= bound, streaming
    # the bound discriminates: the answer grew to far more blocks than it, all measured by a full layout
    assert TOKENS // PARAGRAPH > bound and measured[-1] >= TOKENS // PARAGRAPH


STORY = ("# The keeper\n\nThe lamp was lit at dusk.\n\n## The bottle\n\n```python\nprint('help')\nprint('me')\n```\n\n"
         "- a cork\n- a note\n\n> Come quickly.\n\nShe rowed out.\n\nThe end.\n")


class AnswerApp(App):
    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Answer()


def test_sealed_pieces_show_the_blocks_one_markdown_shows(monkeypatch):
    monkeypatch.setattr(conversation, "SEAL_BLOCKS", 1)
    app = AnswerApp()
    fragments = [STORY[i:i + 7] for i in range(0, len(STORY), 7)]

    def kinds(answer: Answer) -> list[str]:
        return [type(b).__name__ for piece in answer.pieces for b in piece.blocks]

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            answer = app.query_one(Answer)
            for fragment in fragments:
                await answer.append(fragment)
                assert "".join(piece.source for piece in answer.pieces) == answer.text  # no text lost or doubled
            await pilot.pause()
            streamed = kinds(answer)
            assert len(answer.pieces) > 3 and all(piece.sealed for piece in answer.pieces[:-1])
            await answer.settle()
            await pilot.pause()
            assert len(answer.pieces) == 1 and answer.body.source == STORY
            assert streamed == kinds(answer)  # the same blocks as the whole answer parsed at once
            assert "MarkdownFence" in streamed and "MarkdownBulletList" in streamed

    asyncio.run(go())


def test_panel_figures_that_keep_their_height_repaint_without_a_layout(history, monkeypatch):
    layouts: dict[str, list[bool]] = {}
    real_update = Static.update

    def recording_update(self, content="", *, layout=True):
        if self.id:
            layouts.setdefault(self.id, []).append(layout)
        return real_update(self, content, layout=layout)

    monkeypatch.setattr(Static, "update", recording_update)
    app = make_app(history, StorySession())

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            await wait_until(pilot, lambda: chat.panel.figures.state == "idle")
            panel = app.query_one(CachePanel)
            layouts.clear()
            for n in (5, 17, 230):  # one-line figures whose numbers change
                panel.show(panel.figures.__class__(panel.figures.facts, StorySession.stats(n), "streaming"))
            assert layouts["speed"] and not any(layouts["speed"]) and not any(layouts["context"])
            layouts.clear()
            wide = "x" * (panel.query_one("#kv-detail").content_region.width + 5)
            panel._put("kv-detail", wide)  # a line too wide for the panel wraps: its height may change
            assert layouts["kv-detail"] == [True]

    asyncio.run(go())


def test_the_cursor_holds_still_while_an_answer_streams(history):
    session = GatedSession(fake_session())
    app = make_app(history, session)

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            prompt = app.query_one("#prompt")
            assert prompt.cursor_blink
            await send(pilot, "hello")
            await wait_until(pilot, lambda: chat.busy)
            assert not prompt.cursor_blink  # each blink would be a repaint taken from the decoder
            session.gate.set()
            await wait_until(pilot, lambda: not chat.busy)
            assert prompt.cursor_blink

    asyncio.run(go())


def test_the_widget_tree_is_out_of_the_collectors_reach_while_the_chat_runs(history):
    """A full garbage collection while an answer streams walks only what was made since startup: the
    screen and its widgets are frozen once drawn, and handed back to the collector when the app ends."""
    import gc

    app = make_app(history)
    assert gc.get_freeze_count() == 0

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: gc.get_freeze_count() > 0)
            frozen = gc.get_freeze_count()
            assert frozen > 1000  # the imports and the widget tree, not a handful of objects
            await send(pilot, "hello")
            await wait_until(pilot, lambda: app.chat.turn == 1 and not app.chat.busy)
            collectable = [gc.get_objects(generation) for generation in range(3)]
            assert not any(o is app.chat for objects in collectable for o in objects)  # the screen: frozen
            assert gc.get_freeze_count() > frozen // 2

    asyncio.run(go())
    assert gc.get_freeze_count() == 0  # unfrozen on exit: a process running many apps keeps no garbage
