"""Which stream source a server runs (the StreamSource contract: backends/generation/stream_source.py):
continuous batching where the backend has it (torch's ``SlotBatcher``; llama.cpp's ``LlamaSlots``
unless the policy evicts through its context shift), else one stream at a time (``SequentialStreams``)."""
from __future__ import annotations

from localctx.backends.base import Session
from localctx.backends.generation.stream_source import SequentialStreams, StreamSource


def open_streams(planned, parallel: int) -> tuple[Session, StreamSource]:
    """Loads ``planned`` (app/session_options.PlannedSession) for a server: (session, streams).
    On llama.cpp the batched slots hold the plan's KV in their own context, and the session keeps
    only a minimal one beside them (backends/llamacpp/serving.open_slots)."""
    plan = planned.plan
    if parallel > 1 and plan.backend == "llamacpp" and not plan.policy.evicts:
        from localctx.backends.llamacpp.serving import open_slots

        slots = open_slots(planned.ref, plan, parallel, planned.cache_reuse)
        return slots.session, slots
    session = planned.load()
    return session, make_streams(session, parallel)


def make_streams(session: Session, parallel: int) -> StreamSource:
    """The stream source for ``parallel`` streams on a loaded ``session``."""
    if parallel > 1 and session.backend_name == "llamacpp" and not session.plan.policy.evicts:
        from localctx.backends.llamacpp.session import LlamaCppSession
        from localctx.backends.llamacpp.serving import LlamaSlots

        if isinstance(session, LlamaCppSession):
            return LlamaSlots(session, parallel)
    if parallel > 1 and session.backend_name == "torch":  # torch is imported only when it is the backend
        from localctx.backends.torch.serving import SlotBatcher
        from localctx.backends.torch.session import TorchSession

        if isinstance(session, TorchSession):
            return SlotBatcher(session, parallel)
    return SequentialStreams(session)
