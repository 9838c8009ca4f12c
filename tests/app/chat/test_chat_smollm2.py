"""The chat on the real SmolLM2 (llama.cpp): two turns, the second reusing the cached first one."""
from __future__ import annotations

import asyncio

import pytest

from localctx.app.chat.widgets.conversation import Answer
from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError

from chat_helpers import SIZE, RecordingSession, make_app, send_and_wait

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_session():
    try:
        session = open_session(SessionRequest(model=None, backend="llamacpp", context=1024))
    except UserError as exc:
        pytest.skip(f"the llama.cpp backend or the bundled SmolLM2 is not available: {exc}")
    yield session
    session.close()


def test_two_turns_on_smollm2(history, smollm2_session):
    # generous timeouts: on a quiet machine this takes seconds; on a shared one a token can take seconds
    session = RecordingSession(smollm2_session)
    session.reset()
    app = make_app(history, session, params=GenerationParams(max_tokens=8))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "Name one colour of the sky.", timeout=300)
            await send_and_wait(pilot, "And one more?", timeout=300)
            answers = [a.text for a in app.query(Answer)]
            return answers, app.chat.panel.figures

    answers, figures = asyncio.run(go())
    first, second = [e for e in session.events if e.kind == "done"]
    assert all(a.strip() for a in answers), answers
    assert answers[0] == "".join(e.text for e in session.events[:session.events.index(first) + 1])
    assert 0 < first.stats.generated_tokens <= 8
    # the second turn prefilled only what the first did not leave in the cache
    assert second.stats.cached_tokens >= first.stats.prompt_tokens
    assert second.stats.cached_tokens < second.stats.prompt_tokens
    assert figures.stats == second.stats and figures.state == "done"
    assert figures.kv_bytes == cost.kv_bytes(session.spec, session.plan.policy, figures.kv_tokens) > 0
    assert figures.facts.model == session.spec.name and figures.facts.backend == "llamacpp"
