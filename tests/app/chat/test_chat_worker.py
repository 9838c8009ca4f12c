"""The chat with its model in a child process (app/chat/worker_process.py), driven with Textual's
pilot on the fake backend: answers, KV reuse, stop, /kv, key echo while streaming, a child that dies,
and shutdown."""
from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time

from localctx.app.chat.frames import usable_cpus
from localctx.app.chat.widgets.conversation import Answer, Note
from localctx.app.chat.worker_process import ProcessEngine

from chat_helpers import SIZE, expected_reply, long_question, make_worker_app, send, send_and_wait, wait_until


def run(coro):
    return asyncio.run(coro)


async def timed_press(pilot, key: str) -> float:
    """Seconds until the app has handled the key press (the pilot waits for it to be processed)."""
    start = time.perf_counter()
    await pilot.press(key)
    return time.perf_counter() - start


def notes(app) -> list[str]:
    return [n.source for n in app.query(Note)]


def test_answers_come_from_the_child_and_reuse_its_cache(history, monkeypatch):
    app = make_worker_app(history, monkeypatch)
    assert isinstance(app.engine, ProcessEngine)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            await wait_until(pilot, lambda: chat.engine.session is not None, timeout=60)
            # the reader thread sets the session before the UI handles the Loaded message: the panel follows
            await wait_until(pilot, lambda: chat.panel.figures.state != "starting", timeout=10)
            assert chat.engine.process.pid != os.getpid() and chat.engine.process.is_alive()
            assert chat.facts.backend == "fake" and chat.panel.figures.state == "idle"
            # the child's session decodes on one thread: with another core free, frames are not held back
            assert chat.engine.session.decode_threads == 1
            assert chat.pacer.own_core == (usable_cpus() > 1)
            await send_and_wait(pilot, "first question", timeout=30)
            first = chat.conv.messages[-1]
            await send_and_wait(pilot, "second question", timeout=30)
            second = chat.conv.messages[-1]
            return first, second, chat.panel.figures

    first, second, figures = run(go())
    app.engine.close()
    assert not app.engine.process.is_alive()
    asked = [{"role": "user", "content": "first question"}]
    assert first.content == expected_reply(asked)
    asked += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "second question"}]
    assert second.content == expected_reply(asked)
    # the second turn's prompt starts with the first turn's, which stayed in the child's cache
    assert 0 < figures.cached_tokens < figures.stats.prompt_tokens
    assert figures.kv_tokens == figures.stats.prompt_tokens + figures.stats.generated_tokens


def test_stop_reaches_the_child_and_keys_echo_while_it_streams(history, monkeypatch):
    app = make_worker_app(history, monkeypatch, delay=0.1)
    question = long_question()

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            await wait_until(pilot, lambda: chat.engine.session is not None, timeout=60)
            prompt = app.query_one("#prompt")
            prompt.focus()
            idle = [await timed_press(pilot, key) for key in "hello"]  # the same presses with nothing streaming
            prompt.clear()
            await send(pilot, question)
            await wait_until(pilot, lambda: chat.answer is not None and len(chat.answer.text.split()) >= 2, 30)
            echo = []
            for key in "hello":  # each key press is handled (and the input updated) while the answer streams
                echo.append(await timed_press(pilot, key))
                assert chat.busy
            assert prompt.text == "hello"
            streamed_before = len(chat.answer.text.split())
            await pilot.press("escape")
            await wait_until(pilot, lambda: not chat.busy, 30)
            return idle, echo, streamed_before, chat.conv.messages[-1], chat.panel.figures.state

    idle, echo, streamed_before, kept, state = run(go())
    app.engine.close()
    # a press, echoed in the input, takes at most 100 ms longer while an answer streams than when idle
    # (compared within the test: on a loaded host a pilot press alone can take longer than 100 ms)
    assert statistics.median(echo) - statistics.median(idle) < 0.1, (idle, echo)
    full = expected_reply([{"role": "user", "content": question}])
    assert kept.role == "assistant" and kept.stats.finish_reason == "cancelled" and state == "stopped"
    assert full.startswith(kept.content) and streamed_before <= len(kept.content.split()) < len(full.split())


def test_kv_replans_in_the_child(history, monkeypatch):
    app = make_worker_app(history, monkeypatch)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            await wait_until(pilot, lambda: chat.engine.session is not None, timeout=60)
            await send(pilot, "/kv int4+sink4+win64")
            await wait_until(pilot, lambda: str(chat.engine.session.plan.policy) == "int4+sink4+win64"
                             and not chat.busy, 30)
            assert str(chat.facts.plan.policy) == "int4+sink4+win64"
            await send_and_wait(pilot, "after the re-plan", timeout=30)
            return chat.panel.figures

    figures = run(go())
    app.engine.close()
    assert figures.policy == "int4+sink4+win64" and figures.stats.policy == "int4+sink4+win64"


def test_a_child_that_dies_is_one_line_in_the_chat(history, monkeypatch):
    app = make_worker_app(history, monkeypatch, delay=0.1)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            await wait_until(pilot, lambda: chat.engine.session is not None, timeout=60)
            await send(pilot, long_question())
            await wait_until(pilot, lambda: chat.answer is not None and chat.answer.text, 30)
            os.kill(chat.engine.process.pid, signal.SIGKILL)
            await wait_until(pilot, lambda: not chat.busy, 30)
            state = chat.panel.figures.state
            kept = chat.conv.messages[-1]
            await send_and_wait(pilot, "are you there?", timeout=30)  # every later answer says the same line
            return state, notes(app), kept, app.query_one("#prompt").text

    state, shown, kept, prompt = run(go())
    app.engine.close()
    line = "the model's process stopped (signal 9); restart localctx chat to load it again"
    assert state == "failed"
    assert shown.count(line) == 2 and all("\n" not in n for n in shown)
    assert kept.role == "assistant" and kept.content  # what streamed before the child died is kept
    assert prompt == "are you there?"  # the question that could not be answered is back in the input


def test_the_child_is_shut_down_on_exit(history, monkeypatch):
    app = make_worker_app(history, monkeypatch, delay=0.1)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            await wait_until(pilot, lambda: chat.engine.session is not None, timeout=60)
            await send(pilot, long_question())
            await wait_until(pilot, lambda: chat.answer is not None and chat.answer.text, 30)
            await pilot.press("ctrl+q")  # quit mid-answer: the partial answer is kept
            return chat.engine.process

    process = run(go())
    start = time.perf_counter()
    app.engine.close()  # what the command does once the app returns
    assert not process.is_alive() and process.exitcode == 0
    assert time.perf_counter() - start < 5  # it stopped the answer instead of waiting it out or being killed
    saved = history.load(history.conversations()[0].id)
    assert saved.messages[-1].role == "assistant" and saved.messages[-1].stats.finish_reason == "cancelled"


def test_a_model_the_child_cannot_load_is_the_commands_one_line_error(history, monkeypatch):
    """The child's load fails (here: --cache-reuse on a backend without it): the app closes and
    hands the error to the command, which prints it as one line."""
    from dataclasses import replace

    from localctx.app.chat.app import ChatApp
    from localctx.app.chat.setup import ChatSetup
    from localctx.app.chat.worker_process import Opener
    from localctx.app.session_options import SessionRequest, plan_session
    from localctx.kvcache.errors import UserError

    request = SessionRequest(model=None, backend="fake")
    planned = replace(plan_session(request), cache_reuse=256)
    app = ChatApp(ChatSetup(load=planned.load, plan=planned.plan, model="fake", reopen=None, history=history,
                            opener=Opener(planned, request)))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.load_error is not None, timeout=60)

    run(go())
    app.engine.close()
    assert isinstance(app.load_error, UserError) and "--cache-reuse does not apply" in str(app.load_error)
    assert not app.engine.process.is_alive() and app.engine.process.exitcode == 0


def test_the_uis_plan_follows_what_the_childs_session_allocated():
    """A context that grows in the child (llama.cpp's cells moved into a larger one, MLX's buffers as
    they fill) reaches the UI's copy of the plan with the streamed tokens, which the KV panel reads."""
    import multiprocessing
    import threading
    from types import SimpleNamespace

    from localctx.app.chat.chat_engine import Streamed
    from localctx.app.chat.worker_process import SessionInfo, _Child
    from localctx.backends.base import GenerationEvent, GenerationParams, GenerationStats
    from localctx.backends.fake.session import FAKE_SPEC
    from localctx.kvcache import cost

    from chat_helpers import fake_session

    def kv(n: int) -> int:
        return cost.max_kv_bytes(FAKE_SPEC, session.plan.policy, n)

    ui_end, child_end = multiprocessing.Pipe()
    child = _Child(child_end, SimpleNamespace(reopen=None), GenerationParams())
    session = fake_session()
    session.plan = session.plan.sized_to(1000, 1, kv)
    child.engine.session = session
    engine = ProcessEngine.__new__(ProcessEngine)  # the UI side's reader alone, without a child process
    engine._conn, engine._closing, engine._state_lock, engine._pending = ui_end, True, threading.Lock(), None
    engine.session = SessionInfo(session.backend_name, session.spec, session.plan.sized_to(1000, 1, kv),  # a copy
                                 session.decode_threads)
    seen = []
    engine._emit = lambda payload: seen.append((payload, engine.session.plan.allocated_context))
    reader = threading.Thread(target=engine._read)
    reader.start()
    stats = GenerationStats("fake", "fp16", prompt_tokens=3, generated_tokens=1)
    child.send(Streamed(1, GenerationEvent("token", stats, text="a")))
    session.plan.grow_to(2000, kv(2000))  # the child's session grew before its next token
    child.send(Streamed(1, GenerationEvent("done", stats, finish_reason="stop")))
    child_end.close()
    reader.join(10)
    assert [n for _, n in seen] == [1000, 2000]  # each event arrives with the allocation it was made in
    assert engine.session.plan.allocated_bytes == kv(2000) and engine.session.plan is not session.plan
