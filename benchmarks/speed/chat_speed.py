"""Does the chat keep up with `localctx run`? Paired, interleaved runs on the same model, plan,
prompt and max tokens (greedy), each in a fresh process:

- decode: `localctx run` (its own stats line, and tokens ÷ the time between its first and last
  answer bytes on stdout) against the chat app driven headless with Textual's pilot, its model in
  a child process as `localctx chat` runs it (the answer's own stats, and tokens ÷ the time between
  the first and the last frame that drew answer text); with --terminal, `localctx chat` itself in a
  120×40 tmux terminal instead, as a user runs it (the answer's stats line: decode only);
- startup: `localctx chat` in a tmux terminal, launch → the panel says "ready", against
  `localctx run`, launch → its first answer byte on stdout.

The ratios are taken within each pair (runs next to each other in time), since other jobs may
share the machine. Whole runs still drift between processes, so each answer also gets measures
taken within it: its median step, and the share of its time that steps over 1.5x the median took
beyond it (``slow_step_share``: in the chat, mostly the steps the UI's frames stalled). The chat's
steps come from its session's decode clock; run's from the arrival of its stdout writes (one per
token; where fewer arrive, merged under ``chrt -r`` for one, run's are left out). Writes JSON
(default docs/results/run-chat/benchmarks-chat.json) and prints a markdown table.

    python benchmarks/speed/chat_speed.py --pairs 3

With --ui-cost it measures instead what the chat's UI thread costs while a scripted session
streams a 2,000-token answer at a fixed rate (no model): CPU seconds of the UI thread per token,
in the first and the last quarter of the answer, and frames drawn (writes docs/results/run-chat/benchmarks-chat-ui.json).

    python benchmarks/speed/chat_speed.py --ui-cost
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PROMPT = ("Write a long story about a lighthouse keeper who finds a message in a bottle. "
          "Tell it in many paragraphs, with dialogue.")
MAX_TOKENS = 500
STATS_LINE = re.compile(r"\[(\d+) prompt tokens, (\d+) generated, prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s")
ANSWER_STATS = r"([\d,]+) tokens · decode ([\d.]+) tok/s"  # the chat's line under a finished answer

# One chat answer in this process: the real ChatApp (as `localctx chat` builds it) under Textual's pilot.
CHAT_ONCE = r'''
import asyncio, json, sys, time
from localctx.app.chat.app import ChatApp
from localctx.app.chat.setup import ChatSetup
from localctx.app.chat.widgets.conversation import Answer
from localctx.app.chat.worker_process import Opener
from localctx.app.commands.chat import describe_hardware
from localctx.app.history import History
from localctx.app.session_options import SessionRequest, plan_session
from localctx.backends.base import GenerationParams

work = json.loads(sys.argv[1])  # Work's fields, and this script's folder and the prompt
model, kv, prompt, max_tokens, backend = work["model"], work["kv"], work["prompt"], work["max_tokens"], work["backend"]
sys.path.insert(0, work["folder"])  # for slow_steps
from chat_speed import slow_steps
request = SessionRequest(model=model, backend=backend, kv=kv)
planned = plan_session(request)
history, _ = History.open()
app = ChatApp(ChatSetup(load=planned.load, plan=planned.plan, model=planned.spec.name, reopen=None,
                        history=history,  # `localctx chat`'s defaults, as run's: greedy, prompt lookup "auto"
                        params=GenerationParams(max_tokens=max_tokens, temperature=0.0, speculate="auto"),
                        hardware=describe_hardware(), opener=Opener(planned, request)))
stamps = []
real_append = Answer.append
# the decode clock at every streamed token, as the child's session counted it: the steps' own durations
from localctx.app.chat.chat_engine import Streamed
from localctx.app.chat.screens.chat_screen import ChatScreen
decode_clock = []
real_emit = ChatScreen.emit
def emit(self, payload):
    if isinstance(payload, Streamed) and payload.event.kind == "token":
        decode_clock.append(payload.event.stats.decode_s)
    real_emit(self, payload)
ChatScreen.emit = emit
async def append(self, fragment):
    if fragment:
        stamps.append((time.perf_counter(), app.chat.last_stats.generated_tokens))  # tokens drawn by then
    await real_append(self, fragment)
Answer.append = append

ended = []  # set when the answer has ended: this script waits for it without waking the UI's thread
real_ended = ChatScreen.answer_ended
async def answer_ended(self):
    await real_ended(self)
    ended[0].set()
ChatScreen.answer_ended = answer_ended
async def go():
    ended.append(asyncio.Event())
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.chat
        while chat.engine.session is None:  # asyncio.sleep, not pilot.pause: that would force extra redraws
            await asyncio.sleep(0.05)
        prompt_box = app.query_one("#prompt")
        prompt_box.text = prompt
        prompt_box.focus()
        ui_start = time.thread_time()  # this thread is the UI's: its CPU time while the answer streams
        process_start = time.process_time()  # and all of this process's threads (the pipe's reader too)
        await pilot.press("enter")
        await ended[0].wait()  # not a loop polling chat.busy: 20 wake-ups a second of the UI's thread
        reply = chat.conv.messages[-1]
        return (reply.stats, chat.frames_drawn, time.thread_time() - ui_start,
                time.process_time() - process_start, chat.pacer.own_core)
stats, frames, ui_cpu, process_cpu, own_core = asyncio.run(go())
app.engine.close()
print(json.dumps({"generated": stats.generated_tokens, "prompt_tokens": stats.prompt_tokens,
                  "decode_tok_s": stats.decode_tok_s, "tokens_per_step": stats.tokens_per_step,
                  "frames": frames, "ui_own_core": own_core,
                  "ui_cpu_ms_per_token": round(1000 * ui_cpu / stats.generated_tokens, 3),
                  "ui_process_cpu_ms_per_token": round(1000 * process_cpu / stats.generated_tokens, 3),
                  # the tokens drawn between the first and the last frame with text (a frame may carry none)
                  "wall_tok_s": (stamps[-1][1] - stamps[0][1]) / (stamps[-1][0] - stamps[0][0]),
                  "policy": str(planned.plan.policy), **slow_steps(decode_clock)}))
'''


# The UI thread's CPU time while a scripted answer streams at a fixed rate, quarter by quarter.
UI_COST = r'''
import asyncio, json, os, sys, tempfile, threading, time
from localctx.app.chat.app import ChatApp
from localctx.app.chat.setup import ChatSetup
from localctx.app.history import History
from localctx.app.session_options import SessionRequest, make_plan
from localctx.backends.base import GenerationEvent, GenerationParams, GenerationStats
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.backends.models.ref import resolve
from localctx.backends.registry import register

register("fake", "localctx.backends.fake.backend:FakeBackend")  # the test double is not a CLI backend
tokens, rate = int(sys.argv[1]), float(sys.argv[2])
os.environ["LOCALCTX_DATA_DIR"] = tempfile.mkdtemp()
plan = make_plan(SessionRequest(model=None, backend="fake"), FAKE_SPEC)
session = FakeBackend().load(resolve("fake"), plan)
ui_cpu = {}  # tokens streamed -> the UI thread's CPU seconds at that moment (sampled by the UI thread)
ui_thread = threading.main_thread()

def story(prompt, params=GenerationParams(), cancel=None):
    start = time.perf_counter()
    for i in range(tokens):
        time.sleep(max(0.0, start + (i + 1) / rate - time.perf_counter()))
        text = f"word{i % 97}" + (".\n\n" if i % 40 == 39 else " ")
        yield GenerationEvent("token", GenerationStats("fake", "fp16", prompt_tokens=10, generated_tokens=i + 1,
                                                          prefill_s=0.01, decode_s=(i + 1) / rate), text=text)
    yield GenerationEvent("done", GenerationStats("fake", "fp16", prompt_tokens=10, generated_tokens=tokens,
                                                   prefill_s=0.01, decode_s=tokens / rate),
                          finish_reason="stop")
session.generate = story
app = ChatApp(ChatSetup(load=lambda: session, plan=plan, model="fake", reopen=None, history=History.open()[0]))

async def go():
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.chat
        while chat.engine.session is None:
            await asyncio.sleep(0.05)
        box = app.query_one("#prompt")
        box.text = "a long story"
        box.focus()
        await pilot.press("enter")
        while not (chat.turn == 1 and not chat.busy):
            stats = chat.last_stats
            ui_cpu[stats.generated_tokens if stats else 0] = time.thread_time()
            await asyncio.sleep(0.05)
        return chat.frames_drawn
frames = asyncio.run(go())
marks = sorted(ui_cpu.items())
def per_token(lo, hi):
    inside = [(n, c) for n, c in marks if lo <= n <= hi]
    (n0, c0), (n1, c1) = inside[0], inside[-1]
    return (c1 - c0) / (n1 - n0)
q = tokens // 4
print(json.dumps({"tokens": tokens, "tokens_per_s": rate, "frames": frames,
                  "ui_cpu_ms_per_token_first_quarter": 1000 * per_token(1, q),
                  "ui_cpu_ms_per_token_last_quarter": 1000 * per_token(tokens - q, tokens)}))
'''


def slow_steps(clock):
    """``clock``: when each streamed token arrived (or the decode clock at it). Within one answer, so
    the drift between processes that moves whole runs does not enter them: the median step, and the
    steps over 1.5x it (the chat's UI drew a frame, or anything else took a core meanwhile) with the
    share of the answer's time they took beyond the median step."""
    steps = sorted(b - a for a, b in zip(clock, clock[1:]))
    median = steps[len(steps) // 2]
    slow = [d for d in steps if d > 1.5 * median]
    return {"step_ms_median": round(1000 * median, 3), "slow_steps": len(slow),
            "slow_step_share": round(sum(d - median for d in slow) / (clock[-1] - clock[0]), 4)}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "localctx.app.cli", *args]


@dataclass(frozen=True)
class Work:
    """What both sides run: the same model, KV policy, answer length and backend, in ``env``."""
    model: str
    kv: str | None
    max_tokens: int
    backend: str
    env: dict

    def model_args(self) -> list[str]:
        return ["-m", self.model, "--backend", self.backend, *(["--kv", self.kv] if self.kv else [])]


def run_answer(work: Work) -> dict:
    """`localctx run` on PROMPT: its stats line, startup (launch → first answer byte), and tokens ÷
    the time between its first and last answer bytes."""
    args = cli("run", PROMPT, *work.model_args(), "--max-tokens", str(work.max_tokens))
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=work.env)
    first = last = None
    arrivals = []  # each answer chunk's arrival: run writes and flushes every token
    while True:
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        now = time.perf_counter()
        if chunk.strip():
            first = first or now
            last = now
        if chunk:
            arrivals.append(now)
    err = proc.stderr.read().decode()
    if proc.wait() != 0:
        raise SystemExit(f"localctx run failed: {err.strip()}")
    match = STATS_LINE.search(err)
    prompt_tokens, generated, _, decode = int(match[1]), int(match[2]), float(match[3]), float(match[4])
    return {"generated": generated, "prompt_tokens": prompt_tokens, "decode_tok_s": decode,
            "stats_line": err[match.start():].splitlines()[0],
            "wall_tok_s": (generated - 1) / (last - first), "startup_s": first - start, "chunks": len(arrivals),
            # the first token's chunk and the final newline are not steps; where fewer chunks came than
            # tokens (writes merged: this process did not keep up with run's) they are no steps at all
            **(slow_steps(arrivals[1:-1]) if len(arrivals) > generated else
               {"step_ms_median": None, "slow_steps": None, "slow_step_share": None})}


def chat_answer(work: Work) -> dict:
    args = {"model": work.model, "kv": work.kv, "prompt": PROMPT, "max_tokens": work.max_tokens,
            "backend": work.backend, "folder": str(Path(__file__).resolve().parent)}
    out = subprocess.run([sys.executable, "-c", CHAT_ONCE, json.dumps(args)],
                         capture_output=True, text=True, env=work.env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"the headless chat failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


TERMINALS = itertools.count()


class Terminal:
    """`localctx chat` in a 120×40 tmux terminal of its own (a private tmux server), ended on exit."""

    def __init__(self, work: Work, *chat_args: str):
        tmux = shutil.which("tmux")
        if tmux is None:
            raise SystemExit("tmux is not installed (apt-get install -y tmux)")
        # a server of its own each time: a new session on the name of a server still shutting down can vanish
        self.base = [tmux, "-L", f"chat-speed-{os.getpid()}-{next(TERMINALS)}", "-f", "/dev/null"]
        self.env = work.env
        self.command = " ".join(cli("chat", *work.model_args(), *chat_args))

    def tmux(self, *args: str) -> str:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, env=self.env, timeout=30)
        if done.returncode != 0:
            raise SystemExit(f"tmux {args[0]} failed: {done.stderr.strip()}")
        return done.stdout

    def __enter__(self) -> "Terminal":
        # the pane stays when the chat exits, so that what it printed can be read
        self.tmux("new-session", "-d", "-s", "chat", "-x", "120", "-y", "40")
        self.tmux("set-option", "-t", "chat", "remain-on-exit", "on")
        self.started = time.perf_counter()
        self.tmux("respawn-pane", "-k", "-t", "chat", self.command)
        return self

    def ask(self, prompt: str) -> None:
        """Once the chat says it is ready, types ``prompt`` into its input box and sends it."""
        self.wait_for(r"\bready\b", 300, 0.2)
        self.tmux("send-keys", "-t", "chat", "-l", prompt)
        self.tmux("send-keys", "-t", "chat", "Enter")

    def ended(self) -> bool:
        """The chat has exited (its pane stays, dead)."""
        return self.tmux("display-message", "-p", "-t", "chat", "#{pane_dead}").strip() == "1"

    def __exit__(self, *exc) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, env=self.env, timeout=30)

    def wait_for(self, pattern: str, timeout: float, every: float) -> re.Match:
        """The first match of ``pattern`` on the screen (its last 200 lines), looked for every ``every`` s."""
        start = checked = time.perf_counter()
        while time.perf_counter() - start < timeout:
            screen = self.tmux("capture-pane", "-p", "-t", "chat", "-S", "-200")
            found = re.search(pattern, screen)
            if found:
                return found
            failed = "Traceback" in screen or "localctx: error" in screen or "localctx: failed" in screen
            if not failed and time.perf_counter() - checked >= 1.0:  # once a second: each look is a process
                checked = time.perf_counter()
                failed = self.ended()
            if failed:
                raise SystemExit(f"localctx chat failed:\n{screen}")
            time.sleep(every)
        raise SystemExit(f"localctx chat did not show {pattern!r} within {timeout:.0f} s:\n{screen}")


def chat_ready(work: Work) -> float:
    """Seconds from launching `localctx chat` in a 120×40 tmux terminal to the panel saying "ready"."""
    with Terminal(work) as terminal:
        terminal.wait_for(r"\bready\b", 300, 0.05)
        return time.perf_counter() - terminal.started


def terminal_answer(work: Work) -> dict:
    """`localctx chat` in a real terminal (tmux, 120×40), as a user runs it: the answer's own decode figure
    from the stats line under it. The terminal's own work (tmux reading the chat's output and keeping its
    screen) takes from the same cores, which the headless chat does not count; the screen is read every
    0.5 s (a capture costs tmux a few milliseconds)."""
    with Terminal(work, "--max-tokens", str(work.max_tokens)) as terminal:
        terminal.ask(PROMPT)
        found = terminal.wait_for(ANSWER_STATS, 600, 0.5)
    return {"generated": int(found[1].replace(",", "")), "decode_tok_s": float(found[2]),
            "wall_tok_s": None, "slow_step_share": None}


def ui_cost(out: Path, runs: int = 3, tokens: int = 2000, rate: float = 80.0) -> None:
    results = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", UI_COST, str(tokens), str(rate)], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"the UI cost run failed:\n{proc.stderr}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), file=sys.stderr)
    doc = {"command": "python benchmarks/speed/chat_speed.py " + " ".join(sys.argv[1:]), "runs": results,
           "load_average_at_end": os.getloadavg()}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)


def number(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def share(side: dict) -> str:
    return "n/a" if side["slow_step_share"] is None else f"{side['slow_step_share']:.1%}"


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def write(out: Path, args: argparse.Namespace, pairs: list[dict]) -> dict:
    """Writes what was measured so far (after every pair: a long run cut short keeps its pairs)."""
    summary = {key: median([p[key] for p in pairs if p[key] is not None])
               for key in ("decode_ratio", "wall_ratio", "run_slow_step_share", "chat_slow_step_share",
                           "ready_over_run_startup")
               if key in pairs[0] and any(p[key] is not None for p in pairs)}
    result = {"command": "python benchmarks/speed/chat_speed.py " + " ".join(sys.argv[1:]), "prompt": PROMPT,
              "max_tokens": args.max_tokens, "model": Path(args.model).name, "backend": args.backend,
              "chat_side": "tmux terminal" if args.terminal else "headless (Textual pilot)",
              "cpus": os.cpu_count(), "torch_threads": os.environ.get("LOCALCTX_TORCH_THREADS"),
              "load_average_at_end": os.getloadavg(), "pairs": pairs, "median": summary}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)
    return summary


def main() -> None:
    from localctx.backends.models.ref import bundled_default_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("-m", "--model", default=str(bundled_default_path()))
    ap.add_argument("--kv", default=None, help="KV policy for both (default: planned)")
    ap.add_argument("--backend", default="llamacpp", help="backend for both (default llamacpp; torch reads "
                    "LOCALCTX_TORCH_THREADS: with 1 on a 2-core machine the chat's UI has a core of its own)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--out", default=None, help="JSON path (default docs/results/run-chat/benchmarks-chat.json, -ui.json with --ui-cost)")
    ap.add_argument("--no-ready", action="store_true", help="skip the tmux startup timing (decode only)")
    ap.add_argument("--terminal", action="store_true", help="the chat side answers in a tmux terminal, as a user "
                    "runs it, not headless (its decode figure only)")
    ap.add_argument("--ui-cost", action="store_true", help="measure the UI thread's cost per token instead (no model)")
    args = ap.parse_args()
    if args.ui_cost:
        ui_cost(Path(args.out or "docs/results/run-chat/benchmarks-chat-ui.json"))
        return
    args.out = args.out or "docs/results/run-chat/benchmarks-chat.json"
    pairs = []
    with tempfile.TemporaryDirectory() as data:
        env = dict(os.environ, LOCALCTX_DATA_DIR=data, TERM="xterm-256color")
        env.pop("TMUX", None)
        work = Work(args.model, args.kv, args.max_tokens, args.backend, env)
        for i in range(args.pairs):  # alternate which goes first, so neither always has the warmer cache
            order = ("run", "chat") if i % 2 == 0 else ("chat", "run")
            pair: dict = {"order": list(order), "started": time.strftime("%H:%M:%S"), "load_average": os.getloadavg()[0]}
            for side in order:
                if side == "run":
                    pair["run"] = run_answer(work)
                else:
                    pair["chat"] = terminal_answer(work) if args.terminal else chat_answer(work)
                    if not args.no_ready:
                        pair["chat"]["ready_s"] = chat_ready(work)
            pair["decode_ratio"] = round(pair["chat"]["decode_tok_s"] / pair["run"]["decode_tok_s"], 3)
            pair["wall_ratio"] = None if args.terminal else \
                round(pair["chat"]["wall_tok_s"] / pair["run"]["wall_tok_s"], 3)
            for side in ("run", "chat"):
                pair[f"{side}_slow_step_share"] = pair[side]["slow_step_share"]
            if not args.no_ready:
                pair["ready_over_run_startup"] = round(pair["chat"]["ready_s"] / pair["run"]["startup_s"], 3)
            pairs.append(pair)
            print(json.dumps(pair), file=sys.stderr)
            summary = write(Path(args.out), args, pairs)
    print("| pair | run decode tok/s | chat decode tok/s | ratio | run tokens/s (wall) | chat tokens/s (wall) | "
          "ratio | slow steps' share: run / chat | run startup s | chat ready s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, p in enumerate(pairs, 1):
        r, c = p["run"], p["chat"]
        print(f"| {i} | {r['decode_tok_s']:.1f} | {c['decode_tok_s']:.1f} | {p['decode_ratio']:.2f} | "
              f"{number(r['wall_tok_s'], 1)} | {number(c['wall_tok_s'], 1)} | {number(p['wall_ratio'], 2)} | "
              f"{share(r)} / {share(c)} | "
              f"{r['startup_s']:.2f} | "
              f"{c.get('ready_s', float('nan')):.2f} | {p.get('ready_over_run_startup', float('nan')):.2f} |")
    print(f"medians: {summary}")


if __name__ == "__main__":
    main()
