"""Growing a llama.cpp session's context: the plan allocates what the work needs (kvcache/plan.py's
``allocated``) and the session moves to a larger context when a prompt and its answer need more,
up to the plan's context (docs/architecture.md "KV sized to the work").

The cells move: sequence 0's state (its cells' positions and K/V rows, ``llama_state_seq_get_data``)
is copied into a new context on the same weights, so nothing is evaluated again. Re-prefilling the
tokens into the new context was measured slower (benchmarks/speed/kv_growth.py, docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np

CELL = 256  # llama.cpp pads a context to 256 cells (allocation.py)


def next_size(current: int, needed: int, maximum: int) -> int:
    """The context to grow to: at least double the current one, enough for ``needed``, in whole
    cells, at most ``maximum``."""
    want = max(2 * current, -(-needed // CELL) * CELL)
    return min(maximum, want)


def grow_context(llm, n_ctx: int) -> None:
    """Moves ``llm`` (a llama_cpp.Llama) to a new context of ``n_ctx`` cells on the same weights, with
    sequence 0's cells and the token history carried over; the old context is freed."""
    import llama_cpp
    from llama_cpp import _internals

    old = llm._ctx
    n_tokens = int(llm.n_tokens)
    state = None
    if n_tokens:
        size = llama_cpp.llama_state_seq_get_size(old.ctx, 0)
        state = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(old.ctx, state, size, 0)
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} bytes of the sequence's state")
    llm.context_params.n_ctx = n_ctx
    new = _internals.LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
    old.close()  # free the old cells before the copy lands: peak memory is the new context plus the state
    llm._ctx = new
    llm._stack.enter_context(contextlib.closing(new))
    llm._n_ctx = new.n_ctx()
    ids = np.ndarray((llm._n_ctx,), dtype=np.intc)
    ids[:n_tokens] = llm.input_ids[:n_tokens]
    llm.input_ids = ids
    if llm._logits_all:
        scores = np.ndarray((llm._n_ctx, llm._n_vocab), dtype=np.single)
        scores[:n_tokens] = llm.scores[:n_tokens]
        llm.scores = scores
    if state is not None and llama_cpp.llama_state_seq_set_data(new.ctx, state, len(state), 0) == 0:
        raise RuntimeError("llama.cpp refused the sequence's state in the larger context")
