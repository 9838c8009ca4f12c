"""The chat's KV panel shows what is allocated beside the plan's maximum while a session's KV is
smaller than its context (it grows toward it), and the maximum alone once all of it is allocated."""
from __future__ import annotations

import asyncio

from localctx.backends.fake.session import FAKE_SPEC
from localctx.kvcache import cost
from localctx.kvcache.cost import format_bytes

from chat_helpers import SIZE, fake_session, make_app, send_and_wait


def test_panel_shows_allocated_and_planned_kv_as_the_session_grows(history):
    session = fake_session()
    session.plan = session.plan.sized_to(1000, 1, lambda n: cost.max_kv_bytes(FAKE_SPEC, session.plan.policy, n))
    app = make_app(history, session)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            def kv_line() -> str:
                return str(app.chat.panel.query_one("#kv").render())

            await send_and_wait(pilot, "first question")
            small = kv_line()
            session.plan.grow_to(2000, cost.max_kv_bytes(FAKE_SPEC, session.plan.policy, 2000))
            await send_and_wait(pilot, "second question")
            grown = kv_line()
            session.plan.grow_to(4096, session.plan.kv_bytes)
            await send_and_wait(pilot, "third question")
            return small, grown, kv_line()

    small, grown, full = asyncio.run(go())
    planned = format_bytes(session.plan.kv_bytes)
    one_k = format_bytes(cost.max_kv_bytes(FAKE_SPEC, session.plan.policy, 1000))
    two_k = format_bytes(cost.max_kv_bytes(FAKE_SPEC, session.plan.policy, 2000))
    assert f"of {one_k} allocated, {planned} planned" in small
    assert f"of {two_k} allocated, {planned} planned" in grown
    assert f"of {planned} planned" in full and "allocated" not in full
