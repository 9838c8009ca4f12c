"""The plan on llama.cpp: n_ctx, type_k / type_v, flash_attn, and attention sinks + a sliding
window through llama.cpp's context shift.

Sinks + window (StreamingLLM): the cache holds ``n_ctx = sinks + window`` tokens. When the next
batch does not fit, the ``shift_chunk`` oldest tokens after the sinks are removed (``seq_rm``) and
the rest slide down by that many positions (``seq_add``, which re-rotates the cached keys), so
cache positions stay inside the trained context and a session streams past n_ctx indefinitely.
Evicting a chunk at a time, not a token per step, keeps the re-rotation off the per-token cost;
attention therefore sees the sinks plus the last ``window − shift_chunk`` to ``window`` tokens.

What llama.cpp cannot do is refused up front: quantized V needs flash attention (so quantized
formats always run with it), and shifting a quantized K cache dequantises, rotates and
requantises every cached key at each shift, compounding the error — windowed plans keep fp16
keys. The shift moves only K (values carry no position), so a quantized V streams through it
unchanged: kf16v8 / kf16v4 with a window are allowed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from localctx.backends.llamacpp.allocation import CELL_PAD, LlamaCppCache
from localctx.kvcache import calibration
from localctx.kvcache.calibration import Calibration
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec

KV_TYPES = {16: "f16", 8: "q8_0", 4: "q4_0"}  # llama.cpp's formats for our precisions (blocks of 32)


def cache_types(policy: KVPolicy) -> tuple[str, str]:
    """llama.cpp's (type_k, type_v) for ``policy``: each side's precision on its own."""
    return KV_TYPES[policy.k_bits], KV_TYPES[policy.v_bits]


def describe(policy: KVPolicy) -> str:
    """What llama.cpp's cache holds for ``policy``, in words: its ggml types, K and V apart; q8_0 /
    q4_0 quantize every token in blocks of 32 along the head dimension with one fp16 scale a block
    (no full-precision head group or residual, no per-channel key groups); cells padded to 256."""
    type_k, type_v = cache_types(policy)
    sides = f"{type_k} keys and values" if type_k == type_v else f"{type_k} keys, {type_v} values"
    quantized = sorted({t for t in (type_k, type_v) if t != "f16"}, reverse=True)
    if quantized:
        bits = " and ".join(f"{t[1]}-bit" for t in quantized)
        sides += (f" ({bits} blocks of 32 along the head dimension, one fp16 scale a block, for every token; "
                  "no full-precision head or residual, no per-channel key groups)")
    what = [sides, f"cache padded to a multiple of {CELL_PAD} cells"]
    if policy.evicts:
        chunk = shift_chunk(policy.window)
        what.append(f"keeps first {policy.sinks} + last {policy.window - chunk}–{policy.window} tokens "
                    f"(llama.cpp's context shift evicts {chunk} at a time)")
    return ("exact: " if policy.exact else "lossy: ") + "; ".join(what)
SHIFT_CHUNK_MAX = 256
N_BATCH = 512


def shift_chunk(window: int) -> int:
    """Tokens evicted per shift: 1/16 of the window, at most 256 (≤ 6% of the window unseen)."""
    return max(1, min(SHIFT_CHUNK_MAX, window // 16))


@dataclass(frozen=True)
class LlamaCppSettings:
    n_ctx: int
    type_k: str  # llama.cpp type name: "f16", "q8_0", "q4_0"
    type_v: str
    flash_attn: bool
    sinks: int = 0
    window: int | None = None  # None: no context shift; the session ends at n_ctx
    shift_chunk: int = 0
    swa_full: bool = False  # sliding layers at full size: only a context shift needs it (allocation.py)

    def cache(self) -> LlamaCppCache:
        return LlamaCppCache(self.n_ctx, self.type_k, self.type_v, self.flash_attn, self.swa_full)

    def type_ids(self) -> tuple[int, int]:
        import llama_cpp

        return (getattr(llama_cpp, f"GGML_TYPE_{self.type_k.upper()}"),
                getattr(llama_cpp, f"GGML_TYPE_{self.type_v.upper()}"))


def refusals(policy: KVPolicy, spec: ModelSpec | None = None) -> list[str]:
    """What llama.cpp cannot do with ``policy`` beyond its Capabilities (reasons, empty if none)."""
    out = []
    if policy.evicts and policy.k_bits < 16:
        out.append("its context shift would dequantise, re-rotate and requantise the quantized K cache at every "
                   "shift, compounding the error; keep keys at fp16 with a window (e.g. kf16v8+sink4+win4096 or "
                   "fp16+sink4+win4096)")
    if policy.evicts and spec is not None and any(not layer.holds_kv for layer in spec.attention()):
        out.append(f"{spec.name} has recurrent layers, whose state cannot drop old tokens, so llama.cpp "
                   "cannot shift its context; use full-precision or quantized KV without a window")
    if policy.evicts and spec is not None and policy.capacity() > spec.context_length:
        out.append(f"sinks + window ({policy.capacity():,}) exceed {spec.name}'s trained context "
                   f"({spec.context_length:,}); cache positions past it degrade, so use a window up to "
                   f"{spec.context_length - policy.sinks - policy.heavy:,}")
    return out


def flash_attn_for(policy: KVPolicy, cal: Calibration | None, reuse_exact: bool = False) -> bool:
    """Quantized V needs flash attention, and quantized K runs with it. fp16 takes it only where a
    reused prefix stays exact with it for this model on this machine (``reuse_exact``, reuse_probe.py;
    unknown: off, as llama-cpp-python opens a context), and there what ``localctx plan --calibrate``
    measured faster, or on where it has not run (llama.cpp's own default on a CPU, and the setting
    whose verify batches are exact, so prompt lookup drafts: speculate.exact_rows). A session that
    drafts takes the same setting as one that does not, so both answer with the same text."""
    if policy.quantized:
        return True
    if not reuse_exact:
        return False
    fc = cal.cost("fp16") if cal is not None else None
    return bool(fc.settings.get("flash_attn", False)) if fc is not None else True


def local_calibration() -> Calibration | None:
    from localctx.backends.machine.detect import cpu_class

    return calibration.load("llamacpp", cpu_class())


def settings_for(plan: Plan, cal: Calibration | None = None, reuse_exact: bool = False) -> LlamaCppSettings:
    return settings_for_policy(plan.policy, plan.context, cal, reuse_exact)


def settings_for_policy(policy: KVPolicy, context: int, cal: Calibration | None = None,
                        reuse_exact: bool = False) -> LlamaCppSettings:
    """n_ctx and the KV types for ``policy``; sliding layers get the compact SWA cache unless the
    policy streams through a context shift (which a compact SWA cache cannot do); flash attention as
    ``flash_attn_for`` decides."""
    type_k, type_v = cache_types(policy)
    fa = flash_attn_for(policy, cal, reuse_exact)
    if policy.evicts:
        n_ctx = policy.capacity()
        return LlamaCppSettings(n_ctx=n_ctx, type_k=type_k, type_v=type_v, flash_attn=fa, sinks=policy.sinks,
                                window=policy.window, shift_chunk=shift_chunk(policy.window), swa_full=True)
    return LlamaCppSettings(n_ctx=context, type_k=type_k, type_v=type_v, flash_attn=fa)


class ContextShift:
    """Streams tokens through a llama.cpp context that keeps the sinks and a sliding window.

    ``stream`` is every token evaluated since the last reset, so a chat that grows by a turn only
    feeds the new tokens, even after the cache has evicted part of the conversation."""

    def __init__(self, llm, settings: LlamaCppSettings):
        if settings.window is None:
            raise ValueError("ContextShift needs a windowed plan")
        self.llm = llm
        self.s = settings
        self.stream: list[int] = []
        self.evicted = 0

    def reset(self) -> None:
        self.stream = []
        self.evicted = 0

    def cached_prefix(self, ids: list[int]) -> int:
        """Tokens of ``ids`` the cache can keep: the whole stream when ``ids`` extends it; before
        any eviction also the part up to the first differing token (an edited message); else 0."""
        n = len(self.stream)
        if n < len(ids) and ids[:n] == self.stream:
            return n
        if self.evicted:
            return 0
        common = 0
        for a, b in zip(self.stream, ids[:-1]):  # at least one token is evaluated again
            if a != b:
                break
            common += 1
        return common

    def _memory(self):
        import llama_cpp

        return llama_cpp.llama_get_memory(self.llm._ctx.ctx)

    def make_room(self, n_new: int) -> None:
        """Evict the oldest non-sink tokens (a chunk at a time) so that ``n_new`` more fit."""
        import llama_cpp

        llm, s = self.llm, self.s
        n = int(llm.n_tokens)
        if n + n_new <= s.n_ctx:
            return
        discard = min(max(s.shift_chunk, n + n_new - s.n_ctx), n - s.sinks)
        mem = self._memory()
        start, end = s.sinks, s.sinks + discard
        if not llama_cpp.llama_memory_seq_rm(mem, 0, start, end):
            raise RuntimeError("llama.cpp refused to remove tokens from its KV cache")
        llama_cpp.llama_memory_seq_add(mem, 0, end, -1, -discard)
        llm.input_ids[start:n - discard] = llm.input_ids[end:n]
        llm.n_tokens = n - discard
        self.evicted += discard

    def feed(self, ids: list[int]) -> None:
        """Evaluate ``ids`` in batches, shifting the window before each batch that would not fit."""
        step = min(N_BATCH, max(1, self.s.n_ctx - self.s.sinks - 1))
        for i in range(0, len(ids), step):
            batch = ids[i:i + step]
            self.make_room(len(batch))
            self.llm.eval(batch)
            self.stream.extend(batch)

    def prefill(self, prompt_ids: list[int]) -> None:
        """Feeds the part of the prompt not yet streamed (all of it when the stream diverged)."""
        cached = self.cached_prefix(prompt_ids)
        if cached == 0 and (self.stream or self.llm.n_tokens):
            self.llm.reset()
            self.llm._ctx.kv_cache_clear()
            self.reset()
        elif cached < len(self.stream):  # cells are still stream positions: drop those after the edit
            import llama_cpp

            if not llama_cpp.llama_memory_seq_rm(self._memory(), 0, cached, -1):
                raise RuntimeError("llama.cpp refused to remove tokens from its KV cache")
            self.llm.n_tokens = cached
            del self.stream[cached:]
        self.feed(prompt_ids[cached:])

    def tokens(self, prompt_ids: list[int], top_k: int, top_p: float, temperature: float,
               grammar=None) -> Iterator[int]:
        """Feeds the part of the prompt not yet streamed, then samples (under ``grammar``, a LlamaGrammar,
        where given); each next() decodes one step."""
        self.prefill(prompt_ids)
        self.llm._sampler = self.llm._init_sampler(top_k=top_k, top_p=top_p, min_p=0.0, temp=temperature,
                                                   repeat_penalty=1.0, grammar=grammar)
        while True:
            token = self.llm.sample(idx=None)
            yield token
            self.feed([token])
