"""ChatEngine after a failed answer: whatever the backend kept of the failed step, the cached
conversation is dropped (the next answer prefills it again) and the user is told so; a refusal
before anything ran keeps the cache."""
from __future__ import annotations

from localctx.app.chat.chat_engine import ChatEngine, Failed, Streamed
from localctx.backends.base import GenerationParams
from localctx.kvcache.errors import UserError
from summarize_helpers import fake_session


class FailingSession:
    """Streams ``before`` events of the fake session, then raises ``error``; counts resets."""

    prompt_cache = None  # as a Session without a prompt cache on disk

    def __init__(self, error: Exception, before: int = 2):
        self.inner, self.error, self.before, self.resets = fake_session(), error, before, 0

    def generate(self, prompt, params=None, cancel=None):
        for i, event in enumerate(self.inner.generate(prompt, params, cancel)):
            if i == self.before:
                raise self.error
            yield event

    def reset(self):
        self.resets += 1
        self.inner.reset()


def answer(session) -> list:
    engine, out = ChatEngine(reopen=lambda kv: session, params=GenerationParams(max_tokens=8)), []
    engine.load(lambda: session, out.append)
    out.clear()
    engine.answer(1, [{"role": "user", "content": "tell me about caches"}], engine.new_cancel(), out.append)
    return out


def test_an_unexpected_failure_mid_answer_drops_the_cached_conversation():
    session = FailingSession(MemoryError("cannot allocate 3 GiB"))
    events = answer(session)
    assert [type(e) for e in events] == [Streamed, Streamed, Failed]
    assert events[-1].message == ("generation failed: MemoryError: cannot allocate 3 GiB; the cached conversation "
                                  "was dropped, the next answer reads it again")
    assert session.resets == 1 and "MemoryError" in events[-1].detail


def test_a_refusal_before_generation_keeps_the_cache():
    session = FailingSession(UserError("the prompt is too long"), before=0)
    events = answer(session)
    assert events == [Failed(1, "the prompt is too long")] and session.resets == 0
