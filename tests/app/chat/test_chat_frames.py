"""A long answer streams in frames: the screen changes at most once per FRAME_INTERVAL however many
tokens arrive, and each frame parses only the markdown block still open plus the frame's new text,
so the UI's cost per token does not grow with the answer."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from markdown_it import MarkdownIt

from localctx.app.chat import frames as frames_module
from localctx.app.chat.frames import FRAME_INTERVAL, MAX_INTERVAL, UI_SHARE, FrameBuffer, FramePacer, ui_has_own_core
from localctx.app.chat.widgets.cache_panel import CachePanel
from localctx.app.chat.widgets.conversation import Answer
from localctx.backends.base import GenerationEvent, GenerationParams, GenerationStats, Session
from localctx.backends.fake.session import FAKE_SPEC

from chat_helpers import SIZE, RecordingSession, fake_session, make_app, send, wait_until

TOKENS = 2000
PARAGRAPH = 40  # tokens per paragraph; the last token of each ends it with a blank line
TOKEN_SECONDS = 0.002  # a decoder at 500 tok/s: many tokens per frame


def story_tokens() -> list[str]:
    out = []
    for i in range(TOKENS):
        end = i % PARAGRAPH == PARAGRAPH - 1
        out.append(f"word{i % 97}{'.' if end else ''}" + ("\n\n" if end else " "))
    return out


class StorySession(Session):
    """Streams story_tokens() with a fixed delay per token, like a decoder."""

    def __init__(self):
        inner = fake_session()
        self.spec = FAKE_SPEC
        self.plan = inner.plan
        self.backend_name = "fake"

    def generate(self, prompt, params: GenerationParams = GenerationParams(), cancel: threading.Event | None = None):
        tokens = story_tokens()
        for i, text in enumerate(tokens):
            time.sleep(TOKEN_SECONDS)
            yield GenerationEvent("token", self.stats(i + 1), text=text, token=i)
        yield GenerationEvent("done", self.stats(len(tokens)), finish_reason="stop")

    @staticmethod
    def stats(n: int) -> GenerationStats:
        return GenerationStats(backend="fake", policy="fp16", prompt_tokens=10, generated_tokens=n,
                               prefill_s=0.01, decode_s=TOKEN_SECONDS * n, kv_bytes=1000 + n, kv_tokens=10 + n)

    def count_tokens(self, prompt) -> int:
        return 10


def test_a_long_answer_costs_the_same_per_frame_at_its_end_as_at_its_start(history, monkeypatch):
    appended: list[int] = []  # length of each text appended to an answer's Markdown
    parsed: list[tuple[int, int]] = []  # (characters parsed, characters the append that parsed them added)
    panel_shows: list[int] = []
    in_append: list[int] = []

    real_append, real_parse, real_show = Answer.append, MarkdownIt.parse, CachePanel.show

    async def counting_append(self, fragment: str):
        appended.append(len(fragment))
        in_append[:] = [len(fragment)]
        await real_append(self, fragment)
        in_append.clear()

    def counting_parse(self, src: str, env=None):
        if in_append:
            parsed.append((len(src), in_append[0]))
        return real_parse(self, src, env)

    def counting_show(self, figures):
        panel_shows.append(figures.stats.generated_tokens if figures.stats else 0)
        return real_show(self, figures)

    monkeypatch.setattr(Answer, "append", counting_append)
    monkeypatch.setattr(MarkdownIt, "parse", counting_parse)
    monkeypatch.setattr(CachePanel, "show", counting_show)
    app = make_app(history, StorySession())
    full = "".join(story_tokens())

    async def go() -> float:
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            start = time.monotonic()
            await send(pilot, "tell me a long story")
            await wait_until(pilot, lambda: chat.turn == 1 and not chat.busy, timeout=60)
            elapsed = time.monotonic() - start
            answer = app.query(Answer).last()
            assert answer.text == full and answer.body.source == full and len(answer.pieces) == 1  # settled
            paragraphs = [b for b in answer.body.children if b.__class__.__name__ == "MarkdownParagraph"]
            assert len(paragraphs) == TOKENS // PARAGRAPH  # the frames add up to the same document
            return elapsed

    elapsed = asyncio.run(go())
    frames = app.chat.frames_drawn
    # batched: one append per frame, frames paced by FRAME_INTERVAL, far fewer than tokens
    assert len(appended) == frames
    assert 3 <= frames <= elapsed / FRAME_INTERVAL + 2
    assert frames <= TOKENS / 10
    assert len([n for n in panel_shows if n]) <= frames
    # incremental: what a frame parses is the open paragraph plus the frame's text, never the answer so far
    # (a sealed piece's open block is parsed once more, as the start of the next piece)
    paragraph_chars = max(len("".join(story_tokens()[i:i + PARAGRAPH])) for i in range(0, TOKENS, PARAGRAPH))
    assert parsed and all(n <= paragraph_chars + added for n, added in parsed), max(parsed)
    # and that bound discriminates: by some frame the answer so far outgrew it, so a parse of the
    # whole answer there would have broken it (however the frames fell on a loaded machine)
    so_far = [sum(appended[:i + 1]) for i in range(len(appended))]
    assert any(total > 2 * (paragraph_chars + added) for total, added in zip(so_far, appended))


def test_frame_buffer_wakes_once_per_frame_and_at_the_end():
    stats = GenerationStats(backend="fake", policy="fp16")
    frames = FrameBuffer(turn=3)
    wakes = [frames.add(GenerationEvent("token", stats, text=t)) for t in ("a", "b", "c")]
    assert wakes == [True, False, False]  # the first event of a frame wakes the UI, the rest wait for it
    assert not frames.finished
    done = GenerationEvent("done", stats, finish_reason="stop")
    assert frames.add(done) is True and frames.finished  # the end wakes it even while a frame is pending
    frame = frames.take()
    assert (frame.turn, frame.text, frame.events, frame.done) == (3, "abc", 4, done)
    empty = frames.take()
    assert (empty.text, empty.events, empty.stats, empty.done) == ("", 0, None, None)
    assert frames.add(GenerationEvent("token", stats, text="d")) is True  # a new frame wakes it again


def test_pacer_spaces_frames_by_what_drawing_them_costs():
    now = {"wall": 100.0, "cpu": 5.0}
    pacer = FramePacer(clock=lambda: now["wall"], cpu=lambda: now["cpu"])
    assert pacer.wait() == 0  # the first frame of an answer is drawn at once
    pacer.drawn()
    assert pacer.wait() == pytest.approx(FRAME_INTERVAL)
    now["wall"] += FRAME_INTERVAL
    now["cpu"] += 0.2 * FRAME_INTERVAL * UI_SHARE  # cheap frames: the interval stays at its floor
    assert pacer.wait() == 0
    pacer.drawn()
    assert pacer.interval == FRAME_INTERVAL
    now["wall"] += FRAME_INTERVAL
    cost = 0.5 * MAX_INTERVAL * UI_SHARE  # a costly frame: the next one waits cost / UI_SHARE
    now["cpu"] += cost
    pacer.drawn()
    assert pacer.interval == pytest.approx(cost / UI_SHARE) and FRAME_INTERVAL < pacer.interval < MAX_INTERVAL
    now["wall"] += 0.01
    assert pacer.wait() == pytest.approx(cost / UI_SHARE - 0.01)
    now["wall"] += 5
    now["cpu"] += 2.0  # however slow, the answer still moves once per MAX_INTERVAL
    pacer.drawn()
    assert pacer.interval == MAX_INTERVAL
    pacer.reset()
    assert pacer.wait() == 0 and pacer.interval == FRAME_INTERVAL


def test_the_time_a_frame_costs_after_it_is_drawn_holds_back_the_next_one_at_once():
    """The frame's layout runs after the screen's draw call (when the pacer heard of it): the UI time
    spent since then puts the next frame off as soon as it is spent, the answer's second frame too."""
    now = {"wall": 100.0, "cpu": 5.0}
    pacer = FramePacer(clock=lambda: now["wall"], cpu=lambda: now["cpu"])
    pacer.drawn()  # the answer's first frame, drawn at once
    assert pacer.wait() == pytest.approx(FRAME_INTERVAL)  # nothing spent on it yet
    now["wall"] += 0.05
    cost = 0.02  # its layout and render, after draw_frame returned
    now["cpu"] += cost
    assert pacer.wait() == pytest.approx(cost / UI_SHARE - 0.05)  # not FRAME_INTERVAL - 0.05
    now["wall"] += cost / UI_SHARE - 0.05
    assert pacer.wait() == pytest.approx(0)
    now["cpu"] += 10 * MAX_INTERVAL * UI_SHARE  # however much it spends, the answer moves every MAX_INTERVAL
    assert pacer.wait() == pytest.approx(MAX_INTERVAL - cost / UI_SHARE)
    pacer.own_core = True  # a core of its own: FRAME_INTERVAL whatever the UI spends
    assert pacer.wait() == 0
    pacer.reset()
    assert pacer.wait() == 0  # a new answer's first frame: at once


def test_frames_are_not_held_back_where_the_ui_has_a_core_of_its_own():
    now = {"wall": 100.0, "cpu": 5.0}
    pacer = FramePacer(clock=lambda: now["wall"], cpu=lambda: now["cpu"])
    pacer.own_core = True
    pacer.drawn()
    now["wall"] += FRAME_INTERVAL
    now["cpu"] += 0.5 * MAX_INTERVAL * UI_SHARE  # a frame that would hold the next one back when cores are shared
    pacer.drawn()
    assert pacer.interval == FRAME_INTERVAL
    pacer.own_core = False
    now["wall"] += FRAME_INTERVAL
    now["cpu"] += 0.5 * MAX_INTERVAL * UI_SHARE
    pacer.drawn()
    assert pacer.interval == pytest.approx(0.5 * MAX_INTERVAL)


@pytest.mark.parametrize("decode_threads, decodes_here, cpus, own", [
    (0, True, 1, True),  # a server elsewhere decodes: nothing here competes with the UI
    (0, False, 2, True),
    (1, False, 2, True),  # a GPU driven from one thread in the chat's child process
    (8, False, 16, True),  # llama.cpp on the physical cores of an SMT machine
    (2, False, 2, False),  # llama.cpp on every core (this project's 2-core hosts)
    (1, True, 8, False),  # a model in the UI's own process shares its GIL
    (None, False, 64, False),  # a session that may use every core (MLX on a CPU)
])
def test_the_ui_has_its_own_core_only_where_the_decoder_leaves_one(monkeypatch, decode_threads, decodes_here, cpus, own):
    monkeypatch.setattr(frames_module, "usable_cpus", lambda: cpus)
    assert ui_has_own_core(decode_threads, decodes_here) is own


def test_a_remote_session_streams_at_the_frame_rate_and_a_local_one_in_process_is_paced(history):
    """The screen asks the loaded session (Session.decode_threads) whether frames take from the decoder."""
    class Remote(RecordingSession):
        decode_threads = 0

    async def own_core(session) -> bool:
        app = make_app(history, session)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.chat.panel.figures.state == "idle")  # Loaded was handled
            return app.chat.pacer.own_core

    assert asyncio.run(own_core(Remote(fake_session()))) is True
    assert asyncio.run(own_core(fake_session())) is False  # in the UI's process, on a thread of its own
