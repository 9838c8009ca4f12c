"""The one generation loop every backend shares: timing, stop strings, max tokens, cancellation,
incremental UTF-8 decoding. A backend supplies a lazy iterator of token ids (each ``next`` runs
the model) and a way to turn a token into bytes."""
from __future__ import annotations

import codecs
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterable, Iterator

from localctx.backends.base import GenerationEvent, GenerationParams, StatsClock


class StopMatcher:
    """Releases text as it streams, holding back any tail that could begin a stop string."""

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.pending[:min(hits)]
            self.pending = ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class KVProbe:
    """What the cache holds now: called once per event so the UI sees live figures."""
    read: Callable[[], tuple[int, int, int]]  # (kv_bytes, kv_tokens, evicted_tokens)


def stream(tokens: Iterator[int] | Generator[int, None, str | None], *, token_bytes: Callable[[int], bytes], eos: set[int],
           params: GenerationParams, clock: StatsClock, probe: KVProbe,
           cancel: threading.Event | None = None,
           on_accept: Callable[[int], None] | None = None,
           started: float | None = None) -> Iterator[GenerationEvent]:
    """Drives ``tokens`` and yields GenerationEvents, then one "done" event.

    ``clock`` already holds prompt_tokens/cached_tokens; prefill time is the wait for the first
    token, decode time the rest. ``on_accept`` is told each token that became part of the answer.
    ``started`` (a ``time.perf_counter()`` reading): when the prefill began, if before the first
    token is asked for (a batch prefilled before its streams run)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    matcher = StopMatcher(params.stop)
    finish = "length"
    start = time.perf_counter() if started is None else started
    last = start
    try:
        while clock.generated_tokens < params.max_tokens:
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            try:
                tok = next(tokens)
            except StopIteration as end:  # a token source may return its own finish reason
                finish = end.value or "stop"
                break
            now = time.perf_counter()
            if clock.generated_tokens == 0:
                clock.prefill_s = now - start
            else:
                clock.decode_s += now - last
            last = now
            end_of_text = tok in eos
            if end_of_text and not params.ignore_eos:
                finish = "stop"
                clock.stop_token = 1 if clock.generated_tokens else 0  # a decode forward made it
                break
            clock.generated_tokens += 1
            if on_accept is not None:
                on_accept(tok)
            # an end-of-text token that does not end the answer (ignore_eos) counts but shows no text
            text, hit = matcher.feed("" if end_of_text else decoder.decode(token_bytes(tok)))
            yield GenerationEvent("token", clock.stats(*probe.read()), text=text, token=tok)
            if hit:
                finish = "stop"
                break
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
    finally:
        if isinstance(tokens, Generator):
            tokens.close()
    # after a stop string the matcher holds nothing; after EOS or a limit, release what it held
    tail = matcher.flush() + decoder.decode(b"", final=True)
    yield GenerationEvent("done", clock.stats(*probe.read()), text=tail, finish_reason=finish)
