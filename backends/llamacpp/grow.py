"""Growing llama.cpp KV: the plan allocates what the work needs (kvcache/plan.py's ``allocated``) and a
context moves to a larger one when a prompt and its answer need more, up to the plan's context, in
the steps kvcache/growth.py sets (docs/architecture.md "KV sized to the work").

The cells move: each sequence's state (its cells' positions and K/V rows, ``llama_state_seq_get_data``)
is copied into a new context on the same weights, so nothing is evaluated again. Re-prefilling the
tokens into the new context was measured slower (benchmarks/speed/kv_growth.py, docs/benchmarks.md).
A chat's session moves its one sequence (``grow_context``); a server's slots move every slot's
sequence of their multi-sequence context (``move_sequences``, backends/llamacpp/serving.py).
"""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np

CELL = 256  # llama.cpp pads a context to 256 cells (allocation.py)


def read_sequences(ctx, seq_ids: list[int]) -> dict[int, ctypes.Array]:
    """Each sequence's state in ``ctx`` (a llama_context pointer), as llama.cpp writes it; empty
    sequences are left out."""
    import llama_cpp

    states = {}
    for seq_id in seq_ids:
        size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
        if not size:
            continue
        state = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, state, size, seq_id)
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} bytes of sequence {seq_id}'s state")
        states[seq_id] = state
    return states


def write_sequences(ctx, states: dict[int, ctypes.Array]) -> None:
    """The states ``read_sequences`` gave, into ``ctx`` (a larger context on the same weights)."""
    import llama_cpp

    for seq_id, state in states.items():
        if llama_cpp.llama_state_seq_set_data(ctx, state, len(state), seq_id) == 0:
            raise RuntimeError(f"llama.cpp refused sequence {seq_id}'s state in the larger context")


def grow_context(llm, n_ctx: int, keep: int | None = None) -> None:
    """Moves ``llm`` (a llama_cpp.Llama) to a new context of ``n_ctx`` cells on the same weights, with
    sequence 0's cells and the token history carried over; the old context is freed. ``keep``: carry
    only the first ``keep`` tokens (what the next prompt reuses). A compact SWA cache holds its window
    plus a batch of older cells, so a prompt may depart from it a little before its end; llama.cpp writes
    a moved one back with only the window behind its last cell, so that cell must be where the prompt
    goes on, or nothing before it could be reused."""
    import llama_cpp

    if keep is not None and keep < int(llm.n_tokens):
        if not llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm._ctx.ctx), 0, keep, -1):
            raise RuntimeError(f"llama.cpp could not drop the cells after token {keep} before growing")
        llm.n_tokens = keep
    n_tokens = int(llm.n_tokens)
    states = read_sequences(llm._ctx.ctx, [0]) if n_tokens else {}
    llm.context_params.n_ctx = n_ctx
    _replace_context(llm, n_tokens, states)


def reopen(llm, flash_attn: bool) -> None:
    """A new, empty context of the same size on the same weights with flash attention on or off. Its V
    cells are laid out otherwise (transposed without it), so nothing moves: it holds no tokens yet."""
    import llama_cpp

    if int(llm.n_tokens):
        raise RuntimeError("a context is reopened with other flash attention only when it holds no tokens")
    llm.context_params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                          else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    _replace_context(llm, 0, {})


def _replace_context(llm, n_tokens: int, states: dict[int, ctypes.Array]) -> None:
    """Opens a context with ``llm.context_params``, frees the old one, and writes ``states`` into it."""
    from llama_cpp import _internals

    old = llm._ctx
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
    write_sequences(new.ctx, states)
