"""Helpers for the chat tests: a chat app on the fake backend, sessions that record or script events."""
from __future__ import annotations

import asyncio
import io
import threading
from typing import Callable, Iterator

from rich.console import Console

from localctx.app.chat.app import ChatApp
from localctx.app.chat.setup import ChatSetup
from localctx.app.history import History
from localctx.app.session_options import SessionRequest, make_plan
from localctx.backends.base import GenerationEvent, GenerationParams, Prompt, Session
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.backends.models.ref import resolve

SIZE = (120, 36)


def fake_session(kv: str | None = None, delay: float = 0.0, context: int | None = None) -> Session:
    plan = make_plan(SessionRequest(model=None, backend="fake", kv=kv, context=context), FAKE_SPEC)
    return FakeBackend(delay=delay).load(resolve("fake"), plan)


class RecordingSession(Session):
    """Delegates to another session and keeps every event it streamed."""

    def __init__(self, inner: Session):
        self.inner = inner
        self.spec = inner.spec
        self.plan = inner.plan
        self.backend_name = inner.backend_name
        self.events: list[GenerationEvent] = []
        self.prompts: list[Prompt] = []

    def generate(self, prompt: Prompt, params: GenerationParams = GenerationParams(),
                 cancel: threading.Event | None = None) -> Iterator[GenerationEvent]:
        self.prompts.append(prompt)
        for event in self.inner.generate(prompt, params, cancel):
            self.events.append(event)
            yield event

    def count_tokens(self, prompt: Prompt) -> int:
        return self.inner.count_tokens(prompt)

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()


def make_app(history: History, session: Session | None = None, *, delay: float = 0.0, kv: str | None = None,
             context: int | None = None, **setup_kwargs) -> ChatApp:
    session = session or fake_session(kv, delay, context)
    setup = ChatSetup(load=lambda: session, plan=session.plan, model=session.spec.name,
                      reopen=lambda new_kv: fake_session(new_kv, delay, context),
                      history=history, hardware="test machine", **setup_kwargs)
    return ChatApp(setup)


async def wait_until(pilot, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)


async def send(pilot, text: str) -> None:
    """Types ``text`` into the input and presses Enter."""
    prompt = pilot.app.query_one("#prompt")
    prompt.text = text
    prompt.focus()
    await pilot.press("enter")


async def send_and_wait(pilot, text: str, timeout: float = 10.0) -> None:
    chat = pilot.app.chat
    turn = chat.turn
    await send(pilot, text)
    await wait_until(pilot, lambda: chat.turn > turn and not chat.busy, timeout)


def plain(widget) -> str:
    """The text a Static shows (str, rich Text or any rich renderable such as a Table)."""
    content = widget.content
    if isinstance(content, str):
        return content
    console = Console(width=200, file=io.StringIO(), color_system=None)
    console.print(content)
    return console.file.getvalue()


def long_question(stem: str = "tell me all about the cache") -> str:
    """A question the fake backend answers with its longest reply (31 tokens)."""
    text = stem + "?"
    while len(text) % 20 != 19:
        text += "?"
    return text


class GatedSession(RecordingSession):
    """Holds each generation at the start until ``gate`` is set (to stop before the first token)."""

    def __init__(self, inner: Session):
        super().__init__(inner)
        self.gate = threading.Event()

    def generate(self, prompt, params=GenerationParams(), cancel=None):
        self.gate.wait(10)
        yield from super().generate(prompt, params, cancel)


def expected_reply(messages: list[dict]) -> str:
    """What the fake backend answers to ``messages`` with the chat's default params."""
    session = fake_session()
    return "".join(e.text for e in session.generate(messages, ChatSetup.params))


def make_worker_app(history: History, monkeypatch, *, delay: float = 0.0, **setup_kwargs) -> ChatApp:
    """The chat as `localctx chat` runs it: the fake backend's session in a spawned child process
    (the child reads its delay per token from LOCALCTX_FAKE_DELAY, and finds the fake backend
    through LOCALCTX_BACKEND_PLUGINS, both inherited from this process)."""
    from localctx.app.chat.worker_process import Opener
    from localctx.app.session_options import plan_session

    monkeypatch.setenv("LOCALCTX_FAKE_DELAY", str(delay))
    request = SessionRequest(model=None, backend="fake")
    planned = plan_session(request)
    setup = ChatSetup(load=planned.load, plan=planned.plan, model=planned.spec.name, reopen=None,
                      history=history, hardware="test machine", opener=Opener(planned, request), **setup_kwargs)
    return ChatApp(setup)
