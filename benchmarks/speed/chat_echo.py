"""Does the chat echo a key while an answer streams? `localctx chat` in a 120×40 tmux terminal, as a
user runs it: the prompt is sent, and while the answer streams, one letter at a time is typed into the
input box (every ``--every`` seconds); each key's echo time runs from tmux's send-keys to the first
screen capture that shows it (captures are taken back to back, each a few milliseconds: the figure
includes up to one capture's time and tmux's own). Keys whose echo came after the answer ended are
counted apart: they no longer tell how the chat answers while it decodes. Goal: every echo within
100 ms while decoding. Writes JSON (default docs/results/run-chat/chat-echo.json).

    python benchmarks/speed/chat_echo.py --answers 2 --keys 12 --max-tokens 1500
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_speed import ANSWER_STATS, PROMPT, Terminal, Work  # noqa: E402  (a sibling benchmark)

LETTERS = "QXJZ"  # typed in turn: a run of them is not something an answer writes
GOAL_MS = 100.0


def typed_text(count: int) -> str:
    """What the input box holds after ``count`` keys."""
    return "".join(LETTERS[i % len(LETTERS)] for i in range(count))


def echo_times(terminal: Terminal, keys: int, every: float, limit: float = 5.0) -> list[dict]:
    """Types ``keys`` letters, one every ``every`` s; each one's echo time in ms (None: not seen within
    ``limit`` s) and whether the answer was still streaming when it showed."""
    times = []
    for count in range(1, keys + 1):
        typed = typed_text(count)
        start = time.perf_counter()
        terminal.tmux("send-keys", "-t", "chat", "-l", typed[-1])
        echo_ms, screen = None, ""
        while time.perf_counter() - start < limit:
            screen = terminal.tmux("capture-pane", "-p", "-t", "chat", "-S", "-400")
            if typed in screen:
                echo_ms = round(1000 * (time.perf_counter() - start), 1)
                break
        times.append({"echo_ms": echo_ms, "while_streaming": re.search(ANSWER_STATS, screen) is None})
        time.sleep(every)
    return times


def one_answer(work: Work, keys: int, every: float, lead: float) -> dict:
    with Terminal(work, "--max-tokens", str(work.max_tokens)) as terminal:
        terminal.ask(PROMPT)
        time.sleep(lead)  # the answer has started streaming
        times = echo_times(terminal, keys, every)
        found = terminal.wait_for(ANSWER_STATS, 900, 0.5)
    return {"keys": times, "generated": int(found[1].replace(",", "")), "decode_tok_s": float(found[2])}


def summary(answers: list[dict]) -> dict:
    streaming = [k["echo_ms"] for a in answers for k in a["keys"] if k["while_streaming"]]
    seen = [ms for ms in streaming if ms is not None]
    return {"keys_while_streaming": len(streaming), "not_echoed": len(streaming) - len(seen),
            "median_ms": round(statistics.median(seen), 1) if seen else None,
            "max_ms": max(seen) if seen else None,
            "over_goal": sum(1 for ms in streaming if ms is None or ms > GOAL_MS), "goal_ms": GOAL_MS}


def main() -> None:
    from localctx.backends.models.ref import bundled_default_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=str(bundled_default_path()))
    ap.add_argument("--backend", default="llamacpp")
    ap.add_argument("--answers", type=int, default=2, help="answers, each in a fresh terminal and chat")
    ap.add_argument("--keys", type=int, default=12, help="keys typed while each answer streams")
    ap.add_argument("--every", type=float, default=0.3, help="seconds between two keys")
    ap.add_argument("--lead", type=float, default=2.0, help="seconds from sending the prompt to the first key")
    ap.add_argument("--max-tokens", type=int, default=1500, help="long enough to stream through every key")
    ap.add_argument("--out", type=Path, default=Path("docs/results/run-chat/chat-echo.json"))
    args = ap.parse_args()
    if args.answers < 1 or args.keys < 1 or args.every < 0 or args.max_tokens < 1:
        raise SystemExit("--answers, --keys and --max-tokens must be at least 1, --every at least 0")
    answers = []
    with tempfile.TemporaryDirectory() as data:
        env = dict(os.environ, LOCALCTX_DATA_DIR=data, TERM="xterm-256color")
        env.pop("TMUX", None)
        work = Work(args.model, None, args.max_tokens, args.backend, env)
        for _ in range(args.answers):
            answers.append(one_answer(work, args.keys, args.every, args.lead))
            print(json.dumps(answers[-1]), file=sys.stderr)
    result = {"command": "python benchmarks/speed/chat_echo.py " + " ".join(sys.argv[1:]),
              "model": Path(args.model).name, "backend": args.backend, "terminal": "tmux 120x40",
              "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg(), "answers": answers,
              "summary": summary(answers)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.out)
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
