"""Speculative verify on llama.cpp (llama-cpp-python's low-level API): the pending token and the
draft go into one ``llama_decode`` batch with logits requested at every position; the rejected
tail leaves the KV cache through ``llama_memory_seq_rm`` (whole cells, so q8_0 / q4_0 KV rolls
back exactly). Under sinks + window the step never crosses a context shift: a draft is cut to
the cells left before the next shift, and the step that shifts is a plain one-token step.

llama.cpp computes a batch of several tokens with other kernels than a one-token step (weight
repacking switches from GEMV to GEMM at 4 rows; attention without flash attention sums in another
order: docs/benchmarks-reuse.md), so a verify batch's logits are not always the one-token step's.
``exact_rows`` measures, once per session, how many rows a verify batch may have and still give
bit-for-bit the logits of one-token decoding; the session never drafts more than that minus one,
so prompt lookup's text is plain decoding's."""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import numpy as np

from localctx.backends.llamacpp.shift import ContextShift
from localctx.backends.generation.speculation import MAX_DRAFT
from localctx.kvcache.errors import RuntimeFailure


class LlamaCppVerifier:
    """``backends.speculative.Verifier`` over the session's single llama.cpp sequence (seq 0);
    keeps llama-cpp-python's ``input_ids`` / ``n_tokens`` (and the shift's stream) in step."""

    def __init__(self, llm, context_limit: int, shift: ContextShift | None):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llm
        self.shift = shift
        self.limit = shift.s.n_ctx if shift else context_limit
        self.n_vocab = llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(MAX_DRAFT + 1, 0, 1)

    def close(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None

    def room(self) -> int:
        return max(1, self.limit - int(self.llm.n_tokens))

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        lib, llm, b = self.lib, self.llm, self.batch
        T = len(tokens)
        if self.shift:
            self.shift.make_room(T)  # a no-op for a draft (room() kept it short of the shift)
        n = int(llm.n_tokens)
        for j, tok in enumerate(tokens):
            b.token[j] = tok
            b.pos[j] = n + j
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = 0
            b.logits[j] = 1
        b.n_tokens = T
        code = lib.llama_decode(llm._ctx.ctx, b)
        if code != 0:
            raise RuntimeFailure(f"llama.cpp could not decode a {T}-token verify step (code {code})")
        # every position asked for logits: llama.cpp holds them as T rows in batch order; one copy
        out = np.ctypeslib.as_array(lib.llama_get_logits(llm._ctx.ctx), shape=(T, self.n_vocab)).copy()
        llm.input_ids[n:n + T] = tokens
        llm.n_tokens = n + T
        if self.shift:
            self.shift.stream.extend(tokens)
        return out

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        keep = int(self.llm.n_tokens) - n
        if not self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.llm._ctx.ctx), 0, keep, -1):
            raise RuntimeFailure("llama.cpp refused to remove the rejected draft from its KV cache")
        self.llm.n_tokens = keep
        if self.shift:
            del self.shift.stream[-n:]


PROBE_TEXT = ("The river crossing grew into a market town: merchants from the north brought wool, salt and "
              "iron to trade for grain and wine, and by 1200 the town had walls, a bridge and two churches.")
PROBE_OFFSET = 6  # tokens before the second series of batches (a batch in the middle of a text)
# The third series starts past 256 tokens in a context of 512 cells: there llama.cpp's view of the cache
# spans 512 cells, and with fp16 K/V and flash attention a one-token step then splits the cache across
# threads and merges their partial sums, which a verify batch's rows do not (ggml-cpu's
# flash_attn_ext: nek1 >= 512); the first two series, under 256 cells, cannot see it.
PROBE_FAR = 300
PROBE_CELLS = 512  # the probe's own context


def probe_tokens(llm, n: int) -> list[int]:
    ids = llm.tokenize(PROBE_TEXT.encode(), add_bos=True, special=False)
    return (ids * (n // len(ids) + 1))[:n]


class ProbeContext:
    """A small llama.cpp context of its own (``cells`` cells, batches of up to ``rows``) on the session's
    weights, with the session's context settings (KV types, flash attention unless ``flash_attn`` says
    otherwise, threads), so that a probe leaves the session's cache alone (this one; reuse_probe.py)."""

    def __init__(self, llm, rows: int, cells: int, flash_attn: bool | None = None):
        import llama_cpp

        self.lib = L = llama_cpp
        params = L.llama_context_params.from_buffer_copy(llm.context_params)
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = cells, rows, rows, 1
        if flash_attn is not None:
            params.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                      else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = L.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeFailure("llama.cpp could not open a context for a probe")
        self.batch = L.llama_batch_init(rows, 0, 1)
        self.n_vocab, self.n = llm.n_vocab(), 0

    def step(self, tokens: Sequence[int], every_row: bool = True) -> np.ndarray:
        """Logits of every row (a verify step), or of the last only (a prefill, as a session runs one)."""
        b = self.batch
        for j, tok in enumerate(tokens):
            b.token[j], b.pos[j], b.n_seq_id[j] = tok, self.n + j, 1
            b.logits[j] = 1 if every_row or j == len(tokens) - 1 else 0
            b.seq_id[j][0] = 0
        b.n_tokens = len(tokens)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeFailure("llama.cpp could not decode a probe's tokens")
        self.n += len(tokens)
        rows = len(tokens) if every_row else 1
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(rows, self.n_vocab)).copy()

    def rollback(self, n: int) -> None:
        self.n -= n
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), 0, self.n, -1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


class ProbeTimes:
    """The probe's step times by where it started and how many rows the step had: what a verify step
    of T rows costs in one-token steps with this model, KV and machine (``costs``), the draft planner's
    prior (backends/generation/draft_policy.py). It is measured per model and KV because the KV type
    matters: a q8_0 verify step costs more per row than the calibration's fp16 figures say
    (docs/benchmarks-reuse.md, "What a verify step costs")."""

    def __init__(self):
        self.seconds: dict[int, dict[int, list[float]]] = {}  # start → rows → seconds

    def add(self, start: int, rows: int, seconds: float) -> None:
        self.seconds.setdefault(start, {}).setdefault(rows, []).append(seconds)

    def costs(self) -> dict[int, float]:
        """T → the median over the starts of a T-row step's time over the median one-token step's
        there (at least 1)."""
        ratios: dict[int, list[float]] = {}
        for by_rows in self.seconds.values():
            base = statistics.median(by_rows.get(1, [0.0]))
            for rows, seconds in by_rows.items():
                if rows > 1 and base > 0:
                    ratios.setdefault(rows, []).append(max(1.0, min(seconds) / base))
        return {t: round(statistics.median(r), 3) for t, r in sorted(ratios.items())}


def exact_rows_at(probe: ProbeContext, tokens: list[int], start: int, max_rows: int,
                  times: ProbeTimes | None = None) -> int:
    """The largest T ≤ ``max_rows`` such that every verify step of 2..T rows after ``tokens[:start]``
    (prefilled in one batch) gives the logits of one-token steps bit for bit, and the one-token step
    after it too; ``times`` records how long each step took."""
    times = times or ProbeTimes()

    def timed(step_tokens: list[int]) -> np.ndarray:
        started = time.perf_counter()
        out = probe.step(step_tokens)
        times.add(start, len(step_tokens), time.perf_counter() - started)
        return out

    probe.rollback(probe.n)
    if start:
        probe.step(tokens[:start], every_row=False)
    reference = np.concatenate([timed([t]) for t in tokens[start:start + max_rows + 1]])
    probe.rollback(max_rows + 1)

    def exact(rows: int) -> bool:
        batch = timed(tokens[start:start + rows])
        after = timed([tokens[start + rows]])
        probe.rollback(rows + 1)
        return np.array_equal(batch, reference[:rows]) and np.array_equal(after[0], reference[rows])

    best = 1
    while best < max_rows and exact(best + 1):
        best += 1
    return best


def exact_rows(llm, max_rows: int = MAX_DRAFT + 1, times: ProbeTimes | None = None) -> int:
    """The largest T ≤ ``max_rows`` for which a T-token verify step gives bit-for-bit the logits of
    T one-token steps, and leaves a cache from which the next one-token step's logits are bit-equal
    too: checked at the start of a short fixed text, after ``PROBE_OFFSET`` of its tokens and after
    ``PROBE_FAR``, in a context of the probe's own with ``llm``'s settings (the session's cache is not
    touched; about 50 decode steps, and one prefill of PROBE_FAR tokens where the first two hold).
    ``times``: each step's time, for what a verify step costs (ProbeTimes.costs)."""
    probe = ProbeContext(llm, PROBE_FAR, PROBE_CELLS)
    try:
        tokens = probe_tokens(llm, PROBE_FAR + max_rows + 1)
        best = max_rows
        for start in (0, PROBE_OFFSET, PROBE_FAR):
            if best < 2:
                break
            best = exact_rows_at(probe, tokens, start, best, times)
        return best
    finally:
        probe.close()


def last_logits(llm) -> np.ndarray:
    """Logits after the last evaluated token."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()
