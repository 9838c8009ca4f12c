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
PROBE_OFFSET = 6  # one-token steps before the second series of batches (a batch in the middle of a text)
PROBE_TOKENS = PROBE_OFFSET + MAX_DRAFT + 2  # cells the probe needs free after the cached tokens


def probe_tokens(llm, n: int) -> list[int]:
    ids = llm.tokenize(PROBE_TEXT.encode(), add_bos=False, special=False)
    return (ids * (n // len(ids) + 1))[:n]


def exact_rows(verifier: LlamaCppVerifier, max_rows: int = MAX_DRAFT + 1) -> int | None:
    """The largest T ≤ ``max_rows`` for which a T-token verify step gives bit-for-bit the logits of
    T one-token steps, and leaves a cache from which the next one-token step's logits are also
    bit-equal; tried at two places in a short fixed text, after what the cache holds now (so at
    this session's context length and settings), each T from 2 up until one differs. Leaves the
    cache as it found it. None when fewer than ``PROBE_TOKENS`` cells are free (not measured)."""
    if verifier.room() < PROBE_OFFSET + max_rows + 1:
        return None
    tokens = probe_tokens(verifier.llm, PROBE_OFFSET + max_rows + 1)
    reference = np.concatenate([verifier.step([t]) for t in tokens])  # one-token steps
    verifier.rollback(len(tokens))

    def exact(start: int, rows: int) -> bool:
        batch = verifier.step(tokens[start:start + rows])
        after = verifier.step([tokens[start + rows]])
        verifier.rollback(rows + 1)
        return (np.array_equal(batch, reference[start:start + rows])
                and np.array_equal(after[0], reference[start + rows]))

    best = 1
    while best < max_rows and exact(0, best + 1):
        best += 1
    for t in tokens[:PROBE_OFFSET]:
        verifier.step([t])
    try:
        for rows in range(2, best + 1):
            if not exact(PROBE_OFFSET, rows):
                return rows - 1
        return best
    finally:
        verifier.rollback(PROBE_OFFSET)


def last_logits(llm) -> np.ndarray:
    """Logits after the last evaluated token."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()
