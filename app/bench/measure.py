"""One measurement of a localctx backend + KV policy at one context length: load, prefill a prompt of
``context - gen_tokens`` tokens, decode ``gen_tokens`` greedily, read the stats the session streams."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from localctx.app.bench.memory import PeakTracker
from localctx.app.bench.prompt import fit_text
from localctx.kvcache.errors import RuntimeFailure, UserError


@dataclass(frozen=True)
class MeasureRequest:
    backend: str
    policy: str
    model: str | None
    context: int
    gen_tokens: int
    threads: int
    baseline: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> "MeasureRequest":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Sample:
    """What one measurement saw. ``error`` set means the rest is empty."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    kv_bytes: int = 0
    kv_tokens: int = 0
    evicted_tokens: int = 0
    peak_rss_bytes: int = 0
    peak_scope: str = ""
    device_peak_bytes: int | None = None
    load_s: float = 0.0
    finish_reason: str = ""
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Sample":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def plan_context(req: MeasureRequest, trained: int) -> int:
    """The session's context: the measured length, capped at the trained length for windowed
    policies (their stream goes past it; the cache never holds more than its window)."""
    return min(req.context, trained)


def measure_localctx(req: MeasureRequest, tracker: PeakTracker) -> Sample:
    from localctx.app.session_options import SessionRequest, open_session, resolve_model
    from localctx.backends.base import GenerationParams

    _, spec = resolve_model(SessionRequest(model=req.model, backend=req.backend))
    tracker.reset()
    t0 = time.perf_counter()
    session = open_session(SessionRequest(model=req.model, backend=req.backend, kv=req.policy,
                                          context=plan_context(req, spec.context_length)))
    load_s = time.perf_counter() - t0
    try:
        prompt = fit_text(session.count_tokens, req.context - req.gen_tokens)
        done = None
        for event in session.generate(prompt, GenerationParams(max_tokens=req.gen_tokens, temperature=0.0)):
            if event.kind == "done":
                done = event
        if done is None:  # the generation contract promises one "done" event
            raise RuntimeFailure(f"backend {req.backend} ended without a done event")
        peak = tracker.read()
        st = done.stats
        return Sample(prompt_tokens=st.prompt_tokens, generated_tokens=st.generated_tokens,
                      prefill_tok_s=st.prefill_tok_s, decode_tok_s=st.decode_tok_s, kv_bytes=st.kv_bytes,
                      kv_tokens=st.kv_tokens, evicted_tokens=st.evicted_tokens, peak_rss_bytes=peak.rss_bytes,
                      peak_scope=peak.scope, device_peak_bytes=peak.device_bytes, load_s=load_s,
                      finish_reason=done.finish_reason or "")
    finally:
        session.close()


def measure(req: MeasureRequest, tracker: PeakTracker) -> Sample:
    """Runs one measurement; a user-facing or runtime failure becomes the sample's error."""
    from localctx.app.bench.baseline import measure_baseline

    try:
        return measure_baseline(req, tracker) if req.baseline else measure_localctx(req, tracker)
    except (UserError, RuntimeFailure) as exc:
        return Sample(error=str(exc))
