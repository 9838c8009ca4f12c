"""llama.cpp's side of the prompt cache on disk (``kvcache/prompt_cache.py``): the sequence's state
in llama.cpp's own format (``llama_state_seq_get_data`` — its cells' positions and the K/V rows in
the context's KV types, f16 / q8_0 / q4_0), stored as one uint8 tensor and handed back to
``llama_state_seq_set_data`` straight from the memory map."""
from __future__ import annotations

import ctypes

import numpy as np

from localctx.kvcache.prompt_cache import CacheScope, Hit, PromptCache


def scope(model_hash: str, policy: str, type_k: str, type_v: str, flash_attn: bool) -> CacheScope:
    import llama_cpp

    return CacheScope(model_hash=model_hash, backend="llamacpp", policy=policy,
                      layout=f"{type_k}/{type_v}|fa{int(flash_attn)}|llama-cpp-python {llama_cpp.__version__}")


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def save(store: PromptCache, llm, tokens: list[int], kv_bytes: int) -> None:
    """Write sequence 0 of ``llm``, which holds exactly ``tokens``."""
    import llama_cpp

    ctx = llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    buf = np.empty(size, dtype=np.uint8)
    written = llama_cpp.llama_state_seq_get_data(ctx, _ptr(buf), size, 0)
    if written != size:
        raise OSError(f"llama.cpp wrote {written} of {size} state bytes")
    store.save(tokens, {"state": buf}, {"kv_bytes": str(kv_bytes)})


def load(llm, hit: Hit) -> bool:
    """Make sequence 0 hold the hit's first ``hit.n_tokens`` tokens; False if llama.cpp refused
    the state (the sequence is then empty)."""
    import llama_cpp

    ctx = llm._ctx.ctx
    mem = llama_cpp.llama_get_memory(ctx)
    llm.reset()
    llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1)
    state = hit.file.tensors["state"]
    if llama_cpp.llama_state_seq_set_data(ctx, _ptr(state), state.size, 0) == 0:
        llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1)
        return False
    tokens = hit.file.tensors["tokens"]
    llama_cpp.llama_memory_seq_rm(mem, 0, hit.n_tokens, -1)
    llm.input_ids[:hit.n_tokens] = tokens[:hit.n_tokens]
    llm.n_tokens = hit.n_tokens
    return True
