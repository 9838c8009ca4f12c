"""The chat app driven with Textual's pilot on the fake backend."""
from __future__ import annotations

import asyncio

import pytest

from localctx.app.chat.widgets.conversation import Answer, Note, UserMessage
from localctx.app.history import History
from localctx.kvcache.cost import format_bytes

from chat_helpers import (SIZE, GatedSession, RecordingSession, expected_reply, fake_session, long_question, make_app, send,
                      send_and_wait, wait_until)


def run(coro):
    return asyncio.run(coro)


def test_send_streams_the_reply_and_saves_it(history):
    app = make_app(history, delay=0.1)
    question = long_question("hello there friend")

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, question)
            chat = app.chat
            await wait_until(pilot, lambda: chat.answer is not None and len(chat.answer.text.split()) >= 2)
            partial = chat.answer.text
            assert chat.busy and chat.panel.figures.state == "streaming"
            await wait_until(pilot, lambda: not chat.busy)
            full = expected_reply([{"role": "user", "content": question}])
            answers = app.query(Answer)
            assert len(answers) == 1
            assert answers.first().text == full
            assert full.startswith(partial) and len(partial) < len(full)  # it arrived in pieces
            assert answers.first().body.source == full
            assert [str(w.render()) for w in app.query(UserMessage)] == [question]
            assert chat.panel.figures.state == "done"
            assert app.query_one("#prompt").text == ""

    run(go())
    saved = history.load(history.conversations()[0].id)
    assert [(m.role, m.content) for m in saved.messages] == [
        ("user", question), ("assistant", expected_reply([{"role": "user", "content": question}]))]
    assert saved.title == question
    assert saved.messages[1].stats.finish_reason == "stop"


@pytest.mark.parametrize("key", ["escape", "ctrl+c"])
def test_stop_mid_answer_keeps_what_was_generated(history, key):
    app = make_app(history, delay=0.1)
    question = long_question()

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, question)
            chat = app.chat
            await wait_until(pilot, lambda: chat.answer is not None and len(chat.answer.text.split()) >= 3)
            await pilot.press(key)
            await wait_until(pilot, lambda: not chat.busy)
            assert chat.panel.figures.state == "stopped"
            kept = chat.conv.messages[-1]
            assert kept.role == "assistant" and kept.stats.finish_reason == "cancelled"
            assert "stopped" in str(app.query(Answer).last().query_one(".stats").render())
            return kept.content

    kept = run(go())
    full = expected_reply([{"role": "user", "content": question}])
    assert full.startswith(kept) and 0 < len(kept) < len(full)
    saved = history.load(history.conversations()[0].id)
    assert saved.messages[-1].content == kept and saved.messages[-1].stats.finish_reason == "cancelled"


def test_stop_before_the_first_token_gives_the_message_back(history):
    session = GatedSession(fake_session())
    app = make_app(history, session)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, "a question")
            chat = app.chat
            await wait_until(pilot, lambda: chat.busy)
            await pilot.press("escape")
            session.gate.set()
            await wait_until(pilot, lambda: not chat.busy)
            assert chat.conv.messages == []
            assert app.query_one("#prompt").text == "a question"
            assert not app.query(UserMessage) and not app.query(Answer)

    run(go())
    assert all(c.n_messages == 0 for c in history.conversations())


def test_second_turn_reuses_the_cached_prefix(history):
    session = RecordingSession(fake_session())
    app = make_app(history, session)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "first question")
            await send_and_wait(pilot, "second question")

    run(go())
    first, second = [e for e in session.events if e.kind == "done"]
    assert first.stats.cached_tokens == 0
    assert second.stats.cached_tokens > 0  # the first turn was not prefilled again
    assert session.prompts[1][:2] == [{"role": "user", "content": "first question"},
                                      {"role": "assistant", "content": expected_reply(session.prompts[0])}]


def test_panel_figures_equal_the_events_figures(history):
    session = RecordingSession(fake_session("int8+sink4+win16"))
    app = make_app(history, session)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "what does the cache hold now")
            await send_and_wait(pilot, "and after a second question")
            panel = app.chat.panel
            stats = session.events[-1].stats
            f = panel.figures
            assert f.stats == stats
            assert (f.prefill_tok_s, f.decode_tok_s, f.kv_bytes, f.kv_tokens, f.evicted_tokens, f.cached_tokens) == (
                stats.prefill_tok_s, stats.decode_tok_s, stats.kv_bytes, stats.kv_tokens, stats.evicted_tokens,
                stats.cached_tokens)
            assert f.context_used == stats.prompt_tokens + stats.generated_tokens
            assert f.kv_budget == session.plan.kv_bytes and f.context_budget == session.plan.context

            def text(widget_id: str) -> str:
                return str(panel.query_one(widget_id).render())

            assert f"{format_bytes(stats.kv_bytes)} of {format_bytes(session.plan.kv_bytes)}" in text("#kv")
            assert f"cache holds {stats.kv_tokens:,} tokens" in text("#kv-detail")
            assert stats.evicted_tokens > 0
            assert f"evicted {stats.evicted_tokens:,} tokens" in text("#kv-detail")
            assert f"{stats.prompt_tokens + stats.generated_tokens:,} of 4,096 tokens" in text("#context")
            assert f"{stats.cached_tokens:,} reused" in text("#context-detail")
            assert f"prefill {stats.prefill_tok_s:,.1f} tok/s" in text("#speed")
            assert f"decode  {stats.decode_tok_s:,.1f} tok/s" in text("#speed")
            assert "LOSSY" in text("#policy") and "int8+sink4+win16" in text("#policy")
            assert "backend  fake" in text("#session") and "hardware test machine" in text("#session")

    run(go())


def test_panel_follows_each_streamed_event(history):
    """While tokens stream, every figure the panel shows is one an event reported."""
    session = RecordingSession(fake_session(delay=0.25))  # ~8 s: frames come at least once a second
    app = make_app(history, session)
    seen = []

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            turn = chat.turn
            await send(pilot, long_question("watch the figures"))
            while not (chat.turn > turn and not chat.busy):
                if chat.panel.figures.stats is not None:
                    seen.append(chat.panel.figures.stats)
                await pilot.pause(0.01)

    run(go())
    streamed = [e.stats for e in session.events]
    assert len(set(s.generated_tokens for s in seen)) > 2  # it updated as tokens came, not only at the end
    assert all(s in streamed for s in seen)


def test_switch_between_saved_chats(history):
    app = make_app(history)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            await send_and_wait(pilot, "alpha question")
            first_id = chat.conv.id
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: chat.conv.id is None)
            assert not app.query(UserMessage)
            await send_and_wait(pilot, "beta question")
            assert chat.conv.id != first_id
            await pilot.press("ctrl+o")
            await wait_until(pilot, lambda: app.screen.__class__.__name__ == "ConversationsScreen")
            await pilot.press("down", "enter")  # newest first: beta, then alpha
            await wait_until(pilot, lambda: chat.conv.id == first_id)
            shown = [str(w.render()) for w in app.query(UserMessage)]
            assert shown == ["alpha question"]
            assert app.query(Answer).first().text == expected_reply([{"role": "user", "content": "alpha question"}])
            assert chat.sub_title == "alpha question"
            await send_and_wait(pilot, "alpha follow-up")
            return first_id

    first_id = run(go())
    alpha = history.load(first_id)
    assert [m.content for m in alpha.messages if m.role == "user"] == ["alpha question", "alpha follow-up"]


def test_resume_opens_the_latest_chat(history):
    async def first():
        async with make_app(history).run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "remember me")

    run(first())
    app = make_app(history, resume=True)

    async def second():
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: bool(app.query(UserMessage)))
            assert [m.content for m in app.chat.conv.messages][0] == "remember me"

    run(second())


def test_quit_mid_answer_saves_what_was_generated(history):
    app = make_app(history, delay=0.1)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, long_question())
            chat = app.chat
            await wait_until(pilot, lambda: chat.answer is not None and len(chat.answer.text.split()) >= 2)
            await pilot.press("ctrl+q")

    run(go())
    app.engine.close()  # what the command does after the app returns: waits for the worker, frees the model
    saved = history.load(history.conversations()[0].id)
    assert [m.role for m in saved.messages] == ["user", "assistant"]
    full = expected_reply([{"role": "user", "content": long_question()}])
    assert full.startswith(saved.messages[1].content) and 0 < len(saved.messages[1].content) < len(full)
    assert saved.messages[1].stats.finish_reason == "cancelled"


def test_footer_offers_stop_only_while_answering(history):
    app = make_app(history, delay=0.1)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            assert chat.check_action("stop", ()) is None
            await send(pilot, long_question())
            await wait_until(pilot, lambda: chat.answer is not None)
            assert chat.check_action("stop", ()) is True
            await pilot.press("escape")
            await wait_until(pilot, lambda: not chat.busy)
            assert chat.check_action("stop", ()) is None

    run(go())


def test_bar_shows_used_against_budget():
    from localctx.app.chat.widgets.cache_panel import BAR_WIDTH, bar

    assert bar(0, 100).plain == "░" * BAR_WIDTH
    assert bar(50, 100).plain == "█" * (BAR_WIDTH // 2) + "░" * (BAR_WIDTH // 2)
    assert bar(1, 10**9).plain.startswith("█")  # something held is never drawn as nothing
    over = bar(150, 100)
    assert over.plain == "█" * BAR_WIDTH and over.spans[0].style == "red"
    assert bar(0, 0).plain == "░" * BAR_WIDTH
    assert bar(10, 0).plain == "█" * BAR_WIDTH  # anything against no budget is over it


def test_panel_names_heavy_hitters_among_what_was_kept(history):
    app = make_app(history, kv="int8+sink4+win16+heavy8")

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, long_question())
            detail = str(app.chat.panel.query_one("#kv-detail").render())
            evicted = app.chat.panel.figures.evicted_tokens
            assert evicted > 0
            assert f"evicted {evicted:,} tokens; kept the first 4 and the last 16 plus 8 heavy hitters" in detail

    run(go())
