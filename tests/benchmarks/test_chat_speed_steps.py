"""benchmarks/speed/chat_speed.py's measures within one answer: the median step, and the share of the
answer's time that steps over 1.5x the median took beyond it; run's side only where its stdout writes
came one a token."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "speed" / "chat_speed.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("chat_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def clock(steps: list[float]) -> list[float]:
    out = [100.0]
    for step in steps:
        out.append(out[-1] + step)
    return out


def test_steady_steps_have_no_slow_share(bench):
    got = bench.slow_steps(clock([0.010] * 50))
    assert got["step_ms_median"] == pytest.approx(10.0)
    assert got["slow_steps"] == 0 and got["slow_step_share"] == 0


def test_stalled_steps_count_what_they_took_beyond_the_median(bench):
    # 96 steps of 10 ms, 4 stalled to 40 ms (a frame each): 4 x 30 ms beyond the median, of 1.12 s
    got = bench.slow_steps(clock([0.010] * 48 + [0.040] * 4 + [0.010] * 48))
    assert got["step_ms_median"] == pytest.approx(10.0)
    assert got["slow_steps"] == 4
    assert got["slow_step_share"] == pytest.approx(0.120 / 1.12, abs=1e-4)
    # a step under 1.5x the median is an ordinary step
    assert bench.slow_steps(clock([0.010] * 50 + [0.014] * 2))["slow_steps"] == 0


def test_runs_shown_as_na_where_no_share_was_measured(bench):
    assert bench.share({"slow_step_share": None}) == "n/a"
    assert bench.share({"slow_step_share": 0.0412}) == "4.1%"


def test_the_terminal_side_reads_the_chats_own_stats_line(bench):
    """--terminal reads the answer's decode figure off the screen: the line the chat draws under a finished
    answer (app/chat/widgets/conversation.py's stats_line) has to match it, thousands separator included."""
    import re

    from localctx.app.chat.widgets.conversation import stats_line
    from localctx.app.history import TurnStats

    line = stats_line(TurnStats("llamacpp", "fp16", "length", prompt_tokens=55, generated_tokens=1500,
                                prefill_tok_s=214.6, decode_tok_s=135.84))
    found = re.search(bench.ANSWER_STATS, line)
    assert found is not None, line
    assert int(found[1].replace(",", "")) == 1500 and float(found[2]) == 135.8
