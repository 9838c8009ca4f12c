"""The StreamSource contract (backends/generation/stream_source.py) at the scheduler
(app/serve/scheduler.py): a source that declares it is served; an object with the very same
methods that does not declare it is refused before the scheduler starts. The batching sources
are checked against the contract where they are built (tests/backends/torch/test_serve_torch.py,
tests/backends/llamacpp/test_serve_llamacpp.py)."""
from __future__ import annotations

import queue

import pytest

from localctx.app.serve.scheduler import Failed, Refused, Scheduler, ServeJob
from localctx.app.serve.streams import make_streams
from localctx.backends.base import GenerationParams
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.fake.session import FAKE_SPEC
from localctx.backends.generation.stream_source import SequentialStreams, StreamSource
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy

QUESTION = [{"role": "user", "content": "where do the sinks keep tokens"}]
PARAMS = GenerationParams(max_tokens=6)


def fake_session():
    return FakeBackend(0.0).load(None, Plan.fixed("fake", FAKE_SPEC, KVPolicy.parse("fp16"), 4096))


def served_text(scheduler: Scheduler) -> str:
    """One request through the scheduler, to its "done"."""
    events: queue.Queue = queue.Queue()
    assert scheduler.submit(ServeJob(QUESTION, PARAMS, events.put))
    text = ""
    while True:
        event = events.get(timeout=30)
        assert not isinstance(event, (Refused, Failed)), event
        if event.kind == "done":
            return text
        text += event.text


def test_the_scheduler_serves_a_stream_source_and_refuses_a_lookalike_that_does_not_declare_it():
    session = fake_session()
    reference = "".join(e.text for e in session.generate(QUESTION, PARAMS) if e.kind == "token")
    source = make_streams(session, 1)
    assert type(source) is SequentialStreams and isinstance(source, StreamSource)
    own = {k: v for k, v in vars(SequentialStreams).items() if k not in ("__dict__", "__weakref__", "_abc_impl")}
    Lookalike = type("Lookalike", (), own)  # every method and property of SequentialStreams, not the contract
    lookalike = Lookalike(session)
    assert lookalike.start(QUESTION, PARAMS, None)[1].kind == "token"  # it would run...
    lookalike.close()
    with pytest.raises(TypeError, match="must be a StreamSource, not Lookalike"):
        Scheduler(session, lookalike)  # ...but the scheduler takes only what declares the contract
    scheduler = Scheduler(session, source)
    try:
        assert served_text(scheduler) == reference
        assert scheduler.load()["slots"] == 1 and not scheduler.streams.batching
    finally:
        scheduler.close()
