"""Shift-based chunk reuse on llama.cpp (what its server calls ``--cache-reuse N``): when the next
prompt drops part of the cached conversation (a removed or shortened middle message), the cached
tokens after the common prefix that reappear in the prompt in runs of at least ``min_run``
keep their KV. Each run is moved to its new positions — ``llama_memory_seq_rm`` drops the cells
skipped over, ``llama_memory_seq_add`` slides the run down and re-rotates its keys (a K-shift) —
and only the prompt after the last run is prefilled.

The session (``ChunkReuse``) and the server's slots (backends/llamacpp/serving.py) both use it.
Like the server, the runs must follow each other in the prompt with nothing new between them (the
cache may skip tokens, the prompt may not), so an edited message ends the reuse at the edit.

It is lossy: a moved run's keys and values were computed while other tokens preceded it, so the
answer is close to, not equal to, a cold prefill's. Hence opt-in (``enable_cache_reuse``), counted
in the stats (``shifted_tokens``), and never written to the prompt cache on disk (``lossy_below``).
Plain prefix reuse stays exact.

Where it does not apply (``refusal``): a sinks + window session (its context shift already moves
cells), a model with sliding-window layers in llama.cpp's compact cache (cells older than the
window are gone), quantized K (moving a run dequantises, rotates and requantises its keys, once
more at every move), and any model whose memory llama.cpp cannot shift (recurrent layers, no RoPE)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkMove:
    """One reused run: ``n`` cached tokens moved from position ``src`` to ``dst``."""
    src: int
    dst: int
    n: int


def plan_moves(cached: list[int], prompt: list[int], start: int, min_run: int) -> list[ChunkMove]:
    """The runs of ``cached[start:]`` that continue ``prompt[:start]`` in order, each at least
    ``min_run`` tokens (llama.cpp server's scan: the cache head skips a token when no run of
    ``min_run`` starts there; the prompt head moves only past a reused run). The prompt's last
    token is left out: it is evaluated again for the next token's logits."""
    end = len(prompt) - 1
    moves: list[ChunkMove] = []
    head_c = head_p = start
    while head_c < len(cached) and head_p < end:
        n = 0
        while head_c + n < len(cached) and head_p + n < end and cached[head_c + n] == prompt[head_p + n]:
            n += 1
        if n >= min_run:
            moves.append(ChunkMove(head_c, head_p, n))
            head_c += n
            head_p += n
        else:
            head_c += 1
    return moves


def move_runs(llama_cpp, memory, seq_id: int, moves: list[ChunkMove]) -> None:
    """Carry out ``moves`` on sequence ``seq_id`` of a llama.cpp memory: the cells skipped over go,
    each run slides down to its new positions (its keys re-rotated at the next decode)."""
    for m in moves:  # src > dst always: the common prefix ends where the cache and the prompt differ
        if not llama_cpp.llama_memory_seq_rm(memory, seq_id, m.dst, m.src):
            raise RuntimeError("llama.cpp refused to remove tokens from its KV cache")
        llama_cpp.llama_memory_seq_add(memory, seq_id, m.src, m.src + m.n, m.dst - m.src)


def refusal(llm, settings, spec, n_swa: int | None) -> str | None:
    """Why shift-based chunk reuse does not apply to this session (None: it does)."""
    import llama_cpp

    if settings.window is not None:
        return "a sinks + window session already moves its cells through llama.cpp's context shift"
    if n_swa:
        return (f"{spec.name}'s sliding-window layers keep only their last {n_swa:,} cells in llama.cpp's "
                "compact cache, so older runs cannot be moved")
    if settings.type_k != "f16":
        return (f"moving a run of {settings.type_k} keys dequantises, rotates and requantises them, and again "
                "at every later move; use fp16 KV")
    if not llama_cpp.llama_memory_can_shift(llama_cpp.llama_get_memory(llm._ctx.ctx)):
        return f"llama.cpp cannot shift {spec.name}'s memory (recurrent layers or no rotary positions)"
    return None


class ChunkReuse:
    """Applies ``plan_moves`` to a llama-cpp-python context (sequence 0) and remembers the lowest
    position holding a moved cell, so the exact prompt cache on disk never stores one."""

    def __init__(self, llm, min_run: int):
        if min_run < 1:
            raise ValueError("min_run must be at least 1")
        self.llm = llm
        self.min_run = min_run
        self.lossy_from: int | None = None

    def reset(self) -> None:
        self.lossy_from = None

    def lossy_below(self, n_tokens: int) -> bool:
        """Whether the cache's first ``n_tokens`` positions hold a moved (inexact) cell."""
        return self.lossy_from is not None and self.lossy_from < n_tokens

    def apply(self, prompt: list[int]) -> int:
        """Moves the reusable runs of the cache into place for ``prompt`` and makes llama-cpp-python's
        token record match; returns the tokens moved (0 when nothing qualifies: the cache is as it was)."""
        import llama_cpp

        llm = self.llm
        cached = [int(t) for t in llm.input_ids[:llm.n_tokens]]
        start = 0
        for a, b in zip(cached, prompt):
            if a != b:
                break
            start += 1
        if self.lossy_from is not None and self.lossy_from >= start:
            self.lossy_from = None  # the moved cells lie past the common prefix: replaced below or by eval
        moves = plan_moves(cached, prompt, start, self.min_run)
        if not moves:
            return 0
        move_runs(llama_cpp, llama_cpp.llama_get_memory(llm._ctx.ctx), 0, moves)
        end = moves[-1].dst + moves[-1].n
        llm.input_ids[start:end] = prompt[start:end]
        llm.n_tokens = end  # eval removes the cells from here on (the rest of the old cache) before decoding
        first = moves[0].dst
        self.lossy_from = first if self.lossy_from is None else min(self.lossy_from, first)
        return sum(m.n for m in moves)
