"""The chat child's batching of streamed tokens (app/chat/worker_process.py, Batcher): the first token
and the final event go at once, the rest at most once per interval, nothing is lost or reordered, and
any other result first flushes what is held."""
from __future__ import annotations

from localctx.app.chat.chat_engine import Streamed
from localctx.app.chat.worker_process import Batcher, StreamBatch
from localctx.backends.base import GenerationEvent, GenerationStats

STATS = GenerationStats(backend="fake", policy="fp16")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def token(text: str) -> GenerationEvent:
    return GenerationEvent("token", STATS, text)


def test_first_at_once_then_once_per_interval_and_the_end_at_once():
    clock = Clock()
    batcher = Batcher(interval=0.1, clock=clock)
    sent = []
    for i in range(25):  # a token every 10 ms
        sent += batcher.add(Streamed(1, token(f"t{i} ")))
        clock.now += 0.01
    sent += batcher.add(Streamed(1, GenerationEvent("done", STATS, finish_reason="stop")))
    assert all(isinstance(m, StreamBatch) and m.turn == 1 for m in sent)
    assert [len(m.events) for m in sent][0] == 1  # the first token is not held back
    assert sent[-1].events[-1].kind == "done"
    # 250 ms of tokens: the first, then batches at 100 ms and 200 ms, then the rest with the end
    assert len(sent) == 4
    texts = [e.text for m in sent for e in m.events if e.kind == "token"]
    assert texts == [f"t{i} " for i in range(25)]
    assert batcher.flush() == []


def test_another_result_and_another_turn_flush_what_is_held():
    clock = Clock()
    batcher = Batcher(interval=0.1, clock=clock)
    assert len(batcher.add(Streamed(1, token("a")))) == 1
    assert batcher.add(Streamed(1, token("b"))) == []  # held: within the interval
    held = batcher.flush()  # what _Child.send does before a Failed, a Notice or a Loaded
    assert held == [StreamBatch(1, (token("b"),))]
    assert batcher.add(Streamed(1, token("c"))) == []
    out = batcher.add(Streamed(2, token("d")))  # a new answer: the old one's token goes first, then its own at once
    assert out == [StreamBatch(1, (token("c"),)), StreamBatch(2, (token("d"),))]
    assert batcher.add(Streamed(2, token("e"))) == []
    done = GenerationEvent("done", STATS, finish_reason="stop")
    assert batcher.add(Streamed(2, done)) == [StreamBatch(2, (token("e"), done))]
    assert batcher.add(Streamed(3, token("f"))) == [StreamBatch(3, (token("f"),))]
