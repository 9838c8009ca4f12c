"""`localctx chat` in a real terminal (tmux), used as a new user would: start, ask, stop mid-answer,
ask again, quit. Nothing may print a traceback. Needs tmux (apt-get install -y tmux)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localctx.app.history import DB_NAME, History

from chat_helpers import long_question

TMUX = shutil.which("tmux")
ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install -y tmux)")


class Terminal:
    def __init__(self, tmp_path: Path, env: dict):
        self.socket = f"localctx-chat-test-{os.getpid()}"
        self.env = env
        self.screens: list[str] = []

    def tmux(self, *args: str) -> str:
        out = subprocess.run([TMUX, "-L", self.socket, "-f", "/dev/null", *args], capture_output=True, text=True,
                             env=self.env, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def start(self, command: str) -> None:
        self.tmux("new-session", "-d", "-s", "chat", "-x", "120", "-y", "40", command)
        self.tmux("set-option", "-g", "escape-time", "10")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "chat", *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-l", text)

    def screen(self) -> str:
        text = self.tmux("capture-pane", "-p", "-t", "chat", "-S", "-200")
        self.screens.append(text)
        return text

    def wait_for(self, *needles: str, timeout: float = 40.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if all(n in text for n in needles):
                return text
            if "Traceback" in text or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {needles!r}; the terminal shows:\n{text}")
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, env=self.env, timeout=30)


def test_a_new_user_session_shows_no_traceback(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"not a database " * 200)  # a corrupt history must not stop the chat
    env = dict(os.environ, LOCALCTX_DATA_DIR=str(tmp_path), LOCALCTX_FAKE_DELAY="0.2", TERM="xterm-256color")
    env.pop("TMUX", None)
    term = Terminal(tmp_path, env)
    command = f"{sys.executable} -m localctx.app.cli chat --backend fake; echo __EXIT_$?__; sleep 120"
    term.start(command)
    try:
        term.wait_for("Ask anything", "history.db.corrupt-")  # one word: the notice wraps by path length
        term.type("hello there")
        term.keys("Enter")
        term.wait_for("Reply: hello there", "done")
        question = long_question("tell me about the cache")
        term.type(question)
        term.keys("Enter")
        term.wait_for("Reply: tell me about")
        term.keys("Escape")
        term.wait_for("stopped")
        term.type("one more question")
        term.keys("Enter")
        term.wait_for("Reply: one more question", "done")
        term.keys("C-q")
        final = term.wait_for("__EXIT_")
    finally:
        term.close()
    assert "__EXIT_0__" in final
    assert not any("Traceback" in s or "Error" in s for s in term.screens)
    history, notice = History.open(tmp_path / DB_NAME)
    try:
        assert notice is None
        chat = history.load(history.conversations()[0].id)
    finally:
        history.close()
    assert [m.role for m in chat.messages] == ["user", "assistant"] * 3
    assert [m.stats.finish_reason for m in chat.messages[1::2]] == ["stop", "cancelled", "stop"]
    assert chat.messages[3].content.startswith("Reply: tell me about")
    assert any(p.name.startswith("history.db.corrupt-") for p in tmp_path.iterdir())
