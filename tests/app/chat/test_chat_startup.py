"""The chat is up before the model is loaded: the model loads in a worker, a question sent meanwhile
waits for it, and a model that fails to load closes the app with its one-line error."""
from __future__ import annotations

import asyncio
import threading

from localctx.app.chat.app import ChatApp
from localctx.app.chat.setup import ChatSetup
from localctx.app.chat.widgets.conversation import Answer
from localctx.kvcache.errors import RuntimeFailure

from chat_helpers import SIZE, expected_reply, fake_session, send, wait_until


def test_the_screen_is_up_while_the_model_loads(history):
    session = fake_session()
    gate = threading.Event()

    def slow_load():
        gate.wait(10)
        return session

    app = ChatApp(ChatSetup(load=slow_load, plan=session.plan, model=session.spec.name, reopen=lambda kv: session,
                            history=history, hardware="test machine"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            chat = app.chat
            await wait_until(pilot, lambda: bool(chat.query("#prompt")))
            assert chat.panel.figures.state == "starting"
            assert "loading the model" in str(chat.panel.query_one("#state").render())
            assert "model    fake" in str(chat.panel.query_one("#session").render())  # the plan is shown already
            await send(pilot, "asked while loading")
            await pilot.pause(0.2)
            assert chat.busy and not app.query(Answer).last().text  # the answer waits for the model
            gate.set()
            await wait_until(pilot, lambda: not chat.busy)
            assert app.query(Answer).last().text == expected_reply([{"role": "user", "content": "asked while loading"}])
            assert chat.panel.figures.state == "done" and chat.engine.session is session

    asyncio.run(go())


def test_a_model_that_fails_to_load_closes_the_app_with_its_error(history):
    session = fake_session()
    failure = RuntimeFailure("llama.cpp could not load model.gguf: bad magic")

    def broken_load():
        raise failure

    app = ChatApp(ChatSetup(load=broken_load, plan=session.plan, model="model", reopen=lambda kv: session,
                            history=history))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: not app.is_running, timeout=10)

    asyncio.run(go())
    assert app.return_code == 1 and app.load_error is failure
