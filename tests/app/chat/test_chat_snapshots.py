"""Snapshots of the main screen and the plan view (pytest-textual-snapshot; update with --snapshot-update).

A scripted session streams fixed events, so no timing or clock reaches the picture."""
from __future__ import annotations

import threading

from localctx.backends.base import GenerationEvent, GenerationParams, GenerationStats, Session
from localctx.backends.fake.session import FAKE_SPEC
from localctx.kvcache import cost
from localctx.kvcache.plan import Plan, Rejected
from localctx.kvcache.policy import KVPolicy

from chat_helpers import SIZE, make_app, send_and_wait, wait_until

REPLY = [
    "Here ", "is ", "a ", "**sliding** ", "window ", "in ", "Python:\n\n", "```python\n",
    "def window(tokens, sinks=4, keep=256):\n", "    return tokens[:sinks] + tokens[-keep:]\n", "```\n\n",
    "The ", "first ", "`sinks` ", "tokens ", "stay; ", "the ", "middle ", "is ", "evicted.",
]
PROMPT_TOKENS = 300


def lossy_plan() -> Plan:
    policy = KVPolicy.parse("int8+sink4+win256")
    return Plan(backend="fake", policy=policy, context=4096, kv_bytes=cost.max_kv_bytes(FAKE_SPEC, policy, 4096),
                weight_bytes=FAKE_SPEC.weight_bytes, decode_tok_s=42.5, prefill_tok_s=880.0, hardware="snapshot box",
                reasons=["fp16 KV at 4,096 tokens needs more than the 40 KiB budget",
                         "int8+sink4+win256 fits: sinks keep the start, the window keeps the last 256 tokens"],
                rejected=[Rejected("fake", "fp16", "needs 512 KiB of KV; the budget is 40 KiB"),
                          Rejected("fake", "int4+res128", "needs 160 KiB of KV; the budget is 40 KiB")])


class ScriptedSession(Session):
    """Streams REPLY with fixed timings: every figure in the picture is known in advance."""

    def __init__(self, plan: Plan):
        self.spec = FAKE_SPEC
        self.plan = plan
        self.backend_name = "fake"

    def stats(self, generated: int) -> GenerationStats:
        policy = self.plan.policy
        n = PROMPT_TOKENS + generated
        kept = policy.kept_tokens(n)
        return GenerationStats(backend="fake", policy=str(policy), prompt_tokens=PROMPT_TOKENS, cached_tokens=120,
                               generated_tokens=generated, prefill_s=0.25, decode_s=0.05 * max(0, generated - 1),
                               kv_bytes=cost.kv_bytes(self.spec, policy, n), kv_tokens=kept, evicted_tokens=n - kept)

    def generate(self, prompt, params: GenerationParams = GenerationParams(), cancel: threading.Event | None = None):
        for i, text in enumerate(REPLY):
            yield GenerationEvent("token", self.stats(i + 1), text=text, token=i)
        yield GenerationEvent("done", self.stats(len(REPLY)), finish_reason="stop")

    def count_tokens(self, prompt) -> int:
        return PROMPT_TOKENS


async def ask(pilot) -> None:
    await wait_until(pilot, lambda: pilot.app.chat is not None and bool(pilot.app.chat.query("#prompt")))
    pilot.app.chat.query_one("#prompt").cursor_blink = False  # a blinking cursor would make the picture random
    await send_and_wait(pilot, "How do sinks and a window keep a long chat in memory?")
    await pilot.pause(0.2)


def test_main_screen(snap_compare, history):
    app = make_app(history, ScriptedSession(lossy_plan()))
    assert snap_compare(app, terminal_size=SIZE, run_before=ask)


def test_plan_view(snap_compare, history):
    app = make_app(history, ScriptedSession(lossy_plan()))

    async def open_plan(pilot) -> None:
        await ask(pilot)
        await pilot.press("f2")
        await wait_until(pilot, lambda: app.screen.__class__.__name__ == "PlanScreen")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=open_plan)
