"""``localctx chat --backend openai --endpoint URL`` against a running ``localctx serve`` (the fake
backend, served on 127.0.0.1 in a thread), driven headless with Textual's pilot through the real
command: the answer streams in pieces, and the panel and the plan view show the server's KV
policy; ``--kv`` passes through to a lane of its own on the server."""
from __future__ import annotations

import asyncio
import types

import pytest

from localctx.app import cli
from localctx.app.chat.app import ChatApp
from localctx.app.chat.widgets.conversation import Answer
from localctx.app.commands import chat as chat_command
from localctx.app.serve.scheduler import Limits
from localctx.backends.base import GenerationParams
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy

from chat_helpers import SIZE, send, wait_until
from serve_helpers import serve_in_thread

SERVED = "int8+sink4+win512"
QUESTION = "where do the sinks keep the tokens of a long chat"


class _Terminal:
    def isatty(self) -> bool:
        return True


@pytest.fixture
def server():
    session = FakeBackend(0.25).load(None, Plan.fixed("fake", FAKE_SPEC, KVPolicy.parse(SERVED), 2048))
    with serve_in_thread(session, "fake", limits=Limits(kv_lanes_per_min=60)) as (url, _):  # --kv-lanes 60
        yield url  # 0.25 s a token: 12 tokens take 3 s, time for the pilot to see a part of the answer


def chat_through_the_command(monkeypatch, tmp_path, *args: str) -> dict:
    """Runs ``localctx chat ARGS``; the app runs under the pilot instead of on a terminal."""
    monkeypatch.setenv("LOCALCTX_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(chat_command, "sys", types.SimpleNamespace(stdin=_Terminal(), stdout=_Terminal()))
    seen: dict = {}

    async def drive(app: ChatApp) -> None:
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, QUESTION)
            chat = app.chat
            await wait_until(pilot, lambda: chat.answer is not None and len(chat.answer.text.split()) >= 2, timeout=60)
            seen["partial"] = chat.answer.text
            seen["busy_while_partial"] = chat.busy
            await wait_until(pilot, lambda: not chat.busy, timeout=60)
            seen["answer"] = app.query(Answer).first().text
            seen["policy"] = str(app.query_one("#policy").render())
            seen["detail"] = str(app.query_one("#policy-detail").render())
            await pilot.press("f2")
            await wait_until(pilot, lambda: bool(app.screen.query("#plan-reasons")), timeout=30)
            seen["reasons"] = str(app.screen.query_one("#plan-reasons").render())
            await pilot.press("escape")
            app.exit()

    monkeypatch.setattr(ChatApp, "run", lambda self, *a, **k: asyncio.run(drive(self)))
    seen["code"] = cli.main(["chat", *args, "--max-tokens", "12"])
    return seen


def test_chat_with_the_openai_backend_streams_and_shows_the_servers_policy(server, monkeypatch, tmp_path):
    seen = chat_through_the_command(monkeypatch, tmp_path, "--backend", "openai", "--endpoint", server)
    assert seen["code"] == 0
    served = FakeBackend(0.0).load(None, Plan.fixed("fake", FAKE_SPEC, KVPolicy.parse(SERVED), 2048))
    reply = "".join(e.text for e in served.generate([{"role": "user", "content": QUESTION}],
                                                    GenerationParams(max_tokens=12, temperature=0.0)))
    assert seen["answer"] == reply and len(reply.split()) == 12
    assert seen["busy_while_partial"] and reply.startswith(seen["partial"])
    assert len(seen["partial"]) < len(seen["answer"])  # it arrived in pieces over SSE
    assert SERVED in seen["policy"] and "LOSSY" in seen["policy"]
    assert seen["detail"].endswith("keeps first 4 + last 512 tokens")  # the server's own words for its cache
    assert "planned by localctx serve at " + server in seen["reasons"]


def test_chat_kv_passes_through_to_a_lane_on_the_server(server, monkeypatch, tmp_path):
    seen = chat_through_the_command(monkeypatch, tmp_path, "--backend", "openai", "--endpoint", server,
                                    "--kv", "int4+sink4+win256")
    assert seen["code"] == 0 and seen["answer"].strip().startswith("Reply: where do the sinks")
    assert "int4+sink4+win256" in seen["policy"] and "lane" in seen["reasons"]
