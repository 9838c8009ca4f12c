"""benchmarks/speed/chat_echo.py: how it reads a key's echo off the terminal and what it counts."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[2] / "benchmarks" / "speed"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(FOLDER))
    spec = importlib.util.spec_from_file_location("chat_echo", FOLDER / "chat_echo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(FOLDER))


class FakeTerminal:
    """A screen that shows each typed key after ``lag`` captures, and the answer's stats line once
    ``ends_after`` keys were sent."""

    def __init__(self, lag: int, ends_after: int):
        self.lag, self.ends_after = lag, ends_after
        self.typed, self.captures = "", 0

    def tmux(self, command: str, *args: str) -> str:
        if command == "send-keys":
            self.typed += args[-1]
            self.captures = 0
            return ""
        self.captures += 1
        shown = self.typed if self.captures > self.lag else self.typed[:-1]
        stats = "\n500 tokens · decode 90.1 tok/s" if len(self.typed) > self.ends_after else ""
        return f"assistant\nsome answer text{stats}\n> {shown}\n"


def test_each_key_is_timed_to_the_capture_that_shows_it_and_marked_streaming_or_not(bench):
    terminal = FakeTerminal(lag=2, ends_after=2)
    times = bench.echo_times(terminal, keys=4, every=0.0)
    assert bench.typed_text(4) == "QXJZ" and terminal.typed == "QXJZ"
    assert [t["while_streaming"] for t in times] == [True, True, False, False]
    assert all(t["echo_ms"] is not None and t["echo_ms"] >= 0 for t in times)


def test_a_key_never_shown_is_none_and_counts_over_the_goal(bench):
    class Frozen(FakeTerminal):
        def tmux(self, command, *args):
            out = super().tmux(command, *args)
            return out.replace(self.typed, "") if command != "send-keys" else out

    times = bench.echo_times(Frozen(lag=0, ends_after=99), keys=1, every=0.0, limit=0.05)
    assert times == [{"echo_ms": None, "while_streaming": True}]
    result = bench.summary([{"keys": times + [{"echo_ms": 20.0, "while_streaming": True},
                                              {"echo_ms": 500.0, "while_streaming": False}]}])
    # the key after the answer ended is left out; the one never echoed is over the goal
    assert result == {"keys_while_streaming": 2, "not_echoed": 1, "median_ms": 20.0, "max_ms": 20.0,
                      "over_goal": 1, "goal_ms": 100.0}


def test_keys_over_the_goal_are_counted(bench):
    keys = [{"echo_ms": ms, "while_streaming": True} for ms in (15.0, 99.9, 100.1, 250.0)]
    result = bench.summary([{"keys": keys[:2]}, {"keys": keys[2:]}])
    assert result["over_goal"] == 2 and result["max_ms"] == 250.0 and result["median_ms"] == 100.0
