"""Slash commands, the plan view, and errors that must end as a note instead of a crash."""
from __future__ import annotations

import asyncio
import threading

import pytest

from localctx.app.chat import slash
from localctx.app.chat.screens.plan_screen import PlanScreen
from localctx.app.chat.widgets.conversation import Answer, Note, UserMessage
from localctx.kvcache.errors import UserError

from chat_helpers import SIZE, RecordingSession, plain, fake_session, make_app, send, send_and_wait, wait_until


def run(coro):
    return asyncio.run(coro)


def notes(app) -> list[str]:
    return [w.source for w in app.query(Note)]


def test_parse_slash_commands():
    assert slash.parse("hello") is None
    assert slash.parse("//not a command") is None
    assert slash.message_text("//not a command") == "/not a command"
    assert slash.parse("/kv int4+res128") == slash.SlashCommand("kv", "int4+res128")
    assert slash.parse("  /System   be brief ") == slash.SlashCommand("system", "be brief")
    with pytest.raises(UserError, match="unknown command /frobnicate; /help"):
        slash.parse("/frobnicate now")


def test_system_prompt_reaches_the_model(history):
    session = RecordingSession(fake_session())
    app = make_app(history, session)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, "/system answer in one word")
            await wait_until(pilot, lambda: app.chat.conv.system == "answer in one word")
            await send_and_wait(pilot, "hi")
            await send(pilot, "/system none")
            await wait_until(pilot, lambda: app.chat.conv.system == "")
            await send_and_wait(pilot, "again")

    run(go())
    assert session.prompts[0] == [{"role": "system", "content": "answer in one word"}, {"role": "user", "content": "hi"}]
    assert session.prompts[1][0]["role"] == "user"
    assert history.load(history.conversations()[0].id).system == ""


def test_kv_replans_and_the_panel_follows(history):
    app = make_app(history)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "before")
            assert "EXACT" in str(app.chat.panel.query_one("#policy").render())
            await send(pilot, "/kv int4+sink4+win64")
            await wait_until(pilot, lambda: str(app.chat.engine.session.plan.policy) == "int4+sink4+win64"
                             and not app.chat.busy)
            policy_text = str(app.chat.panel.query_one("#policy").render())
            assert "int4+sink4+win64" in policy_text and "LOSSY" in policy_text
            assert any("KV policy is now int4+sink4+win64" in n for n in notes(app))
            await send_and_wait(pilot, "after")
            stats = app.chat.panel.figures.stats
            assert stats.policy == "int4+sink4+win64"
            assert stats.cached_tokens == 0  # a new cache: the chat was prefilled into it
            await send(pilot, "/kv int5")
            await wait_until(pilot, lambda: any("invalid KV policy" in n or "int5" in n for n in notes(app)[-1:]))
            assert str(app.chat.engine.session.plan.policy) == "int4+sink4+win64"

    run(go())


def test_clear_help_and_unknown_commands(history):
    app = make_app(history)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "something to forget")
            await send(pilot, "/clear")
            await wait_until(pilot, lambda: not app.chat.conv.messages)
            assert not app.query(UserMessage) and not app.query(Answer)
            await send(pilot, "/help")
            await wait_until(pilot, lambda: any("/kv POLICY" in n for n in notes(app)))
            await send(pilot, "/nope")
            await wait_until(pilot, lambda: any("unknown command /nope" in n for n in notes(app)))
            assert app.query_one("#prompt").text == "/nope"  # kept so it can be fixed

    run(go())
    assert history.conversations()[0].n_messages == 0


def test_prompt_too_long_is_refused_with_the_message_back(history):
    app = make_app(history, context=24)
    question = " ".join(["word"] * 40)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, question)
            assert app.chat.conv.messages == []
            assert app.query_one("#prompt").text == question
            assert any("the context holds 24" in n for n in notes(app))
            assert app.chat.panel.figures.state == "failed"

    run(go())


class BrokenSession(RecordingSession):
    """Streams two tokens, then the backend fails."""

    def generate(self, prompt, params=None, cancel=None):
        for i, event in enumerate(self.inner.generate(prompt, params, cancel)):
            if i == 2:
                raise RuntimeError("the GPU fell over")
            yield event


def test_a_backend_failure_is_a_note_not_a_crash(history):
    app = make_app(history, BrokenSession(fake_session()))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "break please")
            assert any("generation failed: RuntimeError: the GPU fell over" in n for n in notes(app))
            assert [m.role for m in app.chat.conv.messages] == ["user", "assistant"]  # the partial is kept
            assert app.chat.conv.messages[1].content.startswith("Reply: break")
            await send_and_wait(pilot, "still alive?")
            assert app.is_running

    run(go())


def test_plan_view_shows_the_plan(history):
    app = make_app(history, kv="int8+sink4+win128")

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f2")
            await wait_until(pilot, lambda: isinstance(app.screen, PlanScreen))
            figures = plain(app.screen.query_one("#plan-figures"))
            assert "int8+sink4+win128" in figures and "LOSSY" in figures
            assert "KV policy int8+sink4+win128 from --kv" in plain(app.screen.query_one("#plan-reasons"))
            await pilot.press("escape")
            await wait_until(pilot, lambda: not isinstance(app.screen, PlanScreen))
            await send(pilot, "/plan")
            await wait_until(pilot, lambda: isinstance(app.screen, PlanScreen))

    run(go())
