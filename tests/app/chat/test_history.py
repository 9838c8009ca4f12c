"""Chat history in SQLite: round trips, and a corrupt database moved aside rather than a crash."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from localctx.app.history import DB_NAME, ChatMessage, Conversation, History, TurnStats, data_dir, title_from
from localctx.kvcache.errors import RuntimeFailure

from chat_helpers import SIZE, make_app, wait_until


def stats(finish: str = "stop") -> TurnStats:
    return TurnStats(backend="fake", policy="int8", finish_reason=finish, prompt_tokens=10, cached_tokens=4,
                     generated_tokens=5, prefill_tok_s=100.5, decode_tok_s=20.25, kv_bytes=1234, kv_tokens=15)


def test_data_dir_follows_the_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCTX_DATA_DIR", str(tmp_path / "d"))
    assert data_dir() == tmp_path / "d"
    hist, notice = History.open()
    assert notice is None and (tmp_path / "d" / DB_NAME).is_file()
    hist.close()


def test_round_trip_keeps_messages_stats_and_order(history):
    conv = Conversation(system="be brief")
    for msg in (ChatMessage("user", "first"), ChatMessage("assistant", "one", stats("stop")),
                ChatMessage("user", "second"), ChatMessage("assistant", "tw", stats("cancelled"))):
        conv.messages.append(msg)
        history.add_message(conv, msg)
    other = Conversation()
    other.messages.append(ChatMessage("user", "x" * 100))
    history.add_message(other, other.messages[0])
    loaded = history.load(conv.id)
    assert loaded == conv
    assert loaded.prompt()[0] == {"role": "system", "content": "be brief"}
    assert loaded.messages[3].stats.finish_reason == "cancelled"
    summaries = history.conversations()
    assert [s.id for s in summaries] == [other.id, conv.id]  # newest first
    assert summaries[0].title == title_from("x" * 100) and len(summaries[0].title) == 48
    assert summaries[1].n_messages == 4


def test_remove_clear_delete(history):
    conv = Conversation()
    q = ChatMessage("user", "q")
    conv.messages.append(q)
    history.add_message(conv, q)
    history.remove_message(conv, q)
    assert conv.messages == [] and history.load(conv.id).messages == []
    conv.messages.append(ChatMessage("user", "again"))
    history.add_message(conv, conv.messages[0])
    history.clear(conv)
    assert history.load(conv.id).messages == []
    history.delete(conv.id)
    with pytest.raises(KeyError):
        history.load(conv.id)


@pytest.mark.parametrize("garbage", [b"this is not a database at all" * 100, b"SQLite format 3\x00" + b"\xff" * 5000],
                         ids=["not-sqlite", "bad-header"])
def test_corrupt_database_is_moved_aside(tmp_path, garbage):
    path = tmp_path / DB_NAME
    path.write_bytes(garbage)
    hist, notice = History.open(path)
    try:
        assert notice is not None and "moved to history.db.corrupt-" in notice
        moved = [p for p in tmp_path.iterdir() if p.name.startswith("history.db.corrupt-")]
        assert len(moved) == 1 and moved[0].read_bytes() == garbage
        conv = Conversation()
        conv.messages.append(ChatMessage("user", "works again"))
        hist.add_message(conv, conv.messages[0])
        assert hist.load(conv.id).messages[0].content == "works again"
    finally:
        hist.close()


def test_unwritable_history_is_a_one_line_failure(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(RuntimeFailure, match="cannot create the chat history folder"):
        History.open(blocker / "sub" / DB_NAME)


def test_app_says_the_history_was_moved_aside(tmp_path):
    path = tmp_path / DB_NAME
    path.write_bytes(b"garbage" * 500)
    hist, notice = History.open(path)
    app = make_app(hist, notice=notice)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: any("could not be read" in n.source for n in app.query("Note")))

    asyncio.run(go())
    hist.close()


@pytest.mark.parametrize("args, error", [
    (["--max-tokens", "0"], "--max-tokens 0 must be at least 1"),
    (["--kv", "int5"], "unknown part 'int5'"),
    (["-m", "/no/such/model.gguf"], "model not found"),
    ([], "localctx chat needs a terminal"),
])
def test_cli_chat_bad_input_is_one_line(tmp_path, args, error):
    """Bad options fail before the TUI starts, as one line and exit code 2."""
    env = dict(os.environ, LOCALCTX_DATA_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "localctx.app.cli", "chat", "--backend", "fake", *args],
                         capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("localctx: error: ") and error in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
