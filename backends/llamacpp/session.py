"""A llama.cpp session on llama-cpp-python: one GGUF model and its context (backend.py loads it).

The plan becomes n_ctx and the KV types; generation runs llama.cpp's own decode and sampler and
streams through the shared loop. KV bytes are read back from llama.cpp (its per-sequence state size)."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import io
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

from localctx.backends.generation import speculation
from localctx.backends.llamacpp import cache_reuse, grow, reuse_probe, shift
from localctx.backends.llamacpp import prompt_cache as llama_prompt_cache
from localctx.backends.base import (GenerationEvent, GenerationParams, OutputConstraint, Prompt, Session,
                                    StatsClock, check_prompt_fits, with_template_stops)
from localctx.backends.models.chat_template import ChatTemplate, gguf_template_source
from localctx.backends.llamacpp.allocation import N_UBATCH, held_bytes, swa_cells_held, swa_window
from localctx.backends.models.spec_reader import read_spec
from localctx.backends.models.ref import ModelRef
from localctx.backends.generation.decode_loop import KVProbe, stream
from localctx.kvcache import growth, prompt_cache
from localctx.kvcache.calibration import verify_costs
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.prompt_cache import PromptCache

# Prompt tokens evaluated again when a prompt reuses cached cells (llama-cpp-python replays one, for the
# logits). llama.cpp computes a one-row batch with other kernels than a longer one: on fp16 KV a prompt's
# last row replayed alone differed from the cold run's by up to 0.8 in a logit past ~250 tokens (AVX2,
# without flash attention), while replays of two rows and more were bit-equal (docs/benchmarks-reuse.md).
REPLAY = 2


def default_threads() -> int:
    try:
        import psutil
        physical = psutil.cpu_count(logical=False)
    except ImportError:  # pragma: no cover - psutil is a declared dependency
        physical = None
    return max(1, physical or os.cpu_count() or 1)


@contextlib.contextmanager
def quiet_stderr(log: list[str] | None = None):
    """llama.cpp prints load logs from C on fd 2 even with verbose=False, and llama-cpp-python its
    error log through sys.stderr; keep the user's terminal clean. With ``log``, what was printed
    either way is kept there (its lines), so a failed load can say why."""
    py_sink, saved_py = io.StringIO(), sys.stderr
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (embedded use): nothing to silence
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        sys.stderr = py_sink
        try:
            yield
        finally:
            sys.stderr = saved_py
            os.dup2(saved, 2)
            os.close(saved)
            if log is not None:
                sink.seek(0)
                log.extend(sink.read().decode("utf-8", errors="replace").splitlines())
                log.extend(py_sink.getvalue().splitlines())


def set_llama_log(verbose: bool) -> None:
    """llama-cpp-python's log callback (it prints llama.cpp's log to stderr) up to every line, or back
    to errors only (a verbose load turned it up): the level of its logger, as ``Llama(verbose=...)`` sets it."""
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)


def load_failure_reason(log: list[str]) -> str:
    """The line of llama.cpp's log that says why a model did not load (its "error loading model: ..."
    where there is one, else its last error or failure)."""
    for words in (("error loading model",), ("error",), ("failed",)):
        for line in reversed(log):
            if any(w in line.lower() for w in words):
                return line.strip().split("error loading model: ")[-1][:200]
    return "no reason in its log"


@functools.lru_cache(maxsize=None)
def _ggml_base():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_row_size.restype = ctypes.c_size_t
    return lib


def ggml_row_size(type_id: int, n_elements: int) -> int:
    """Bytes llama.cpp stores for one row of ``n_elements`` of a ggml type (blocks and scales included)."""
    return int(_ggml_base().ggml_row_size(type_id, n_elements))


class EndOfGeneration:
    """Set-like membership test for llama.cpp's end-of-generation tokens (EOS, EOT, ...)."""

    def __init__(self, llm):
        import llama_cpp

        self._vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self._is_eog = llama_cpp.llama_vocab_is_eog

    def __contains__(self, token: int) -> bool:
        return bool(self._is_eog(self._vocab, token))


class LlamaCppSession(Session):
    def __init__(self, ref: ModelRef, plan: Plan, threads: int | None = None, own_context: int | None = None):
        """``own_context``: the cells of this session's own context when another context on the same
        weights holds the plan's KV (serve's slots, serving.open_slots); by default the plan's."""
        from llama_cpp import Llama

        self.spec = read_spec(ref)
        # whoever made the plan, the session says what llama.cpp holds
        self.plan = dataclasses.replace(plan, kv_layout=shift.describe(plan.policy))
        self.backend_name = "llamacpp"
        policy = plan.policy
        cal = shift.local_calibration()
        if plan.context > self.spec.context_length and not policy.evicts:
            raise UserError(f"--context {plan.context:,} is past {self.spec.name}'s trained context "
                            f"({self.spec.context_length:,}); lower it or use a windowed --kv policy")
        n_threads = threads or default_threads()
        self.decode_threads = n_threads
        # fp16 takes flash attention where it keeps a reused prefix exact here (reuse_probe.py): remembered
        # per model, CPU and build, else probed on the loaded weights below
        self.settings = shift.settings_for(plan, cal)
        type_k, type_v = self.settings.type_ids()
        probe_key = (None if policy.quantized else
                     reuse_probe.cache_key(ref.path, type_k, type_v, self.settings.swa_full, n_threads))
        self.reuse_exact = reuse_probe.cached(probe_key) if probe_key else None
        self.settings = shift.settings_for(plan, cal, bool(self.reuse_exact))
        # prompt lookup's prior: the calibration's fp16 figure until verify_rows() measures this model and KV's
        self.verify_cost = cal.verify_step_cost if cal is not None else {}
        log: list[str] = []
        try:
            with quiet_stderr(log):
                # the plan's allocation (a context that grows, grow.py), or a fixed one a server's slots share
                self._fixed_context = own_context is not None or policy.evicts
                n_ctx = own_context or min(self.settings.n_ctx, plan.allocated_context)
                self.llm = Llama(model_path=str(ref.path), n_ctx=n_ctx, n_threads=n_threads,
                                 n_threads_batch=n_threads, n_batch=512, n_ubatch=N_UBATCH, type_k=type_k,
                                 type_v=type_v, flash_attn=self.settings.flash_attn,
                                 swa_full=self.settings.swa_full, verbose=True)  # the log, into ``log``
            self.llm.verbose = False  # no per-call chatter from here on
            set_llama_log(False)
        except (ValueError, RuntimeError):
            set_llama_log(False)
            raise UserError(f"llama.cpp cannot load {ref.path.name} ({load_failure_reason(log)}); use a GGUF of an "
                            "architecture this llama-cpp-python supports, or update it") from None
        if probe_key and self.reuse_exact is None:
            self.reuse_exact = reuse_probe.reuse_exact_with_flash_attention(self.llm)
            reuse_probe.remember(probe_key, self.reuse_exact)
            self._set_flash_attention(shift.flash_attn_for(policy, cal, self.reuse_exact))
        t0 = time.perf_counter()
        source = self.llm.metadata.get("tokenizer.chat_template")
        self.template = ChatTemplate(gguf_template_source(source), bos_token=self._piece(self.llm.token_bos()),
                                     eos_token=self._piece(self.llm.token_eos()))
        self.load_parts = {"template": time.perf_counter() - t0}
        self.eog = EndOfGeneration(self.llm)  # ``token in session.eog``: the model's end-of-generation tokens
        self._shift = shift.ContextShift(self.llm, self.settings) if policy.evicts else None
        self._n_swa = None if self.settings.swa_full else swa_window(self.spec)  # compact SWA cache
        self._chunks: cache_reuse.ChunkReuse | None = None  # opt-in: enable_cache_reuse()
        # rows a verify batch may have and match one-token decoding bit for bit (speculate.exact_rows):
        # remembered per model, CPU, build and context settings, else measured at the first answer with
        # prompt lookup (1: no drafts)
        self.exact_rows: int | None = None
        self._rows_key = functools.partial(reuse_probe.cache_key, ref.path, type_k, type_v, self.settings.swa_full,
                                           n_threads)

    # -- prompts ---------------------------------------------------------------
    def _piece(self, token: int) -> str:
        if token < 0:
            return ""
        return self.llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
        text = self.template.render(prompt)
        add_bos = not (self.template.bos_token and text.startswith(self.template.bos_token))
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def count_tokens(self, prompt: Prompt) -> int:
        return len(self.tokenize(prompt))

    # -- cache -----------------------------------------------------------------
    def kv_state(self) -> tuple[int, int, int]:
        """(KV bytes held, tokens held, tokens evicted): the tokens in llama.cpp's context, at most its
        window in a sliding layer, at llama.cpp's own row sizes for the K and V types in use, so
        q8_0/q4_0 block scales are counted (allocation.held_bytes)."""
        n = int(self.llm.n_tokens)
        return self.held_bytes(n), n, self._shift.evicted if self._shift else 0

    def held_bytes(self, n_tokens: int) -> int:
        return held_bytes(self.spec, self.settings.type_k, self.settings.type_v, n_tokens)

    def allocated_bytes(self, n_ctx: int) -> int:
        """KV bytes llama.cpp allocates for a context of ``n_ctx`` cells in this session's settings."""
        return dataclasses.replace(self.settings, n_ctx=n_ctx).cache().bytes(self.spec)

    def fit(self, needed: int, prompt_ids: list[int]) -> None:
        """Grows the context to hold ``needed`` tokens (at least doubling, at most the plan's context), the
        cells ``prompt_ids`` reuses moved into the larger one (grow.py); the plan then says what is allocated."""
        have, most = int(self.llm.n_ctx()), self.settings.n_ctx
        if self._fixed_context or not growth.must_grow(have, needed, most):
            return
        n = growth.next_size(have, needed, most, grow.CELL)
        grow.grow_context(self.llm, n, keep=self._cached_prefix(prompt_ids))
        self.plan.grow_to(n, self.allocated_bytes(n))

    def _set_flash_attention(self, on: bool) -> None:
        """The still-empty context reopened with flash attention ``on`` where it was opened otherwise."""
        if on == self.settings.flash_attn:
            return
        grow.reopen(self.llm, on)
        self.settings = dataclasses.replace(self.settings, flash_attn=on)
        # the same cells, their bytes in the new V layout (a server's slots record their own)
        if not self._fixed_context:
            n = self.plan.allocated_context
            self.plan.grow_to(n, self.allocated_bytes(n))

    def reset(self) -> None:
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        if self._shift:
            self._shift.reset()
        if self._chunks is not None:
            self._chunks.reset()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.close()

    # -- generation ------------------------------------------------------------
    def next_token_logits(self, prompt: Prompt):
        """Logits for the token after ``prompt`` (a fresh evaluation; used by correctness tests and eval)."""
        import numpy as np
        import llama_cpp

        tokens = self.tokenize(prompt)
        self.reset()
        self.llm.eval(tokens)
        logits = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).copy()

    def _cached_prefix(self, tokens: list[int], replay: int = REPLAY) -> int:
        """Tokens of ``tokens`` the cache already holds and generate() will reuse. A compact SWA cache
        has dropped sliding-layer cells older than its window, so a prefix ending more than a window
        before the cache's end cannot be reused: the cache is cleared and the prompt evaluated anew."""
        n = 0
        for a, b in zip(self.llm._input_ids, tokens):
            if a != b:
                break
            n += 1
        reuse = max(0, min(n, len(tokens) - replay))
        if self._n_swa and reuse > 0:
            import llama_cpp

            pos_min = llama_cpp.llama_memory_seq_pos_min(llama_cpp.llama_get_memory(self.llm._ctx.ctx), 0)
            if not swa_cells_held(pos_min, reuse, self._n_swa):
                self.reset()
                return 0
        return reuse

    def tool_format(self):
        return self.template.tool_format

    def constraint_refusal(self, constraint: OutputConstraint) -> str | None:
        """llama.cpp's grammar engine (grammar.py): None when the schema's grammar parses."""
        import llama_cpp

        from localctx.backends.llamacpp import grammar  # structured output only: off run's start-up path

        return grammar.refusal(llama_cpp.llama_model_get_vocab(self.llm.model), constraint)

    def enable_cache_reuse(self, min_run: int) -> str | None:
        """Keep runs of at least ``min_run`` cached tokens that reappear later in the next prompt,
        moved into place (cache_reuse.py; lossy); returns why not, or None."""
        reason = cache_reuse.refusal(self.llm, self.settings, self.spec, self._n_swa)
        if reason is None:
            self._chunks = cache_reuse.ChunkReuse(self.llm, min_run)
        return reason

    def _reuse_chunks(self, prompt_ids: list[int], clock: StatsClock) -> None:
        if self._chunks is not None:
            clock.shifted_tokens = self._chunks.apply(prompt_ids)
            # chunk reuse keeps llama-cpp-python's one-token replay (its moved cells are not exact anyway)
            clock.cached_tokens = max(clock.cached_tokens, self._cached_prefix(prompt_ids, replay=1))

    # -- the prompt cache on disk --------------------------------------------------------
    def enable_prompt_cache(self, model_path: Path) -> str | None:
        if self._shift:
            return "a windowed llama.cpp session (context shift) keeps no prompt cache on disk"
        policy = str(self.plan.policy)
        self.prompt_cache = PromptCache(lambda: llama_prompt_cache.scope(  # the settings of the moment it is used
            prompt_cache.model_hash(model_path), policy, self.settings.type_k, self.settings.type_v,
            self.settings.flash_attn))
        return None

    def _disk_prefix(self, prompt_ids: list[int], clock: StatsClock) -> None:
        """Before prefill: load a file that covers more of the prompt than the context does (up to
        the first token where they differ: llama.cpp cuts its cells anywhere), and evaluate all
        but the prompt's last REPLAY tokens and save that to disk when it adds a chunk or more."""
        store = self.prompt_cache
        if store is None:
            return
        start = self._cached_prefix(prompt_ids)
        hit = store.lookup(prompt_ids, len(prompt_ids) - REPLAY)
        if hit is not None and hit.n_tokens > start:
            if llama_prompt_cache.load(self.llm, hit):
                start = clock.cached_tokens = clock.loaded_tokens = hit.n_tokens
                if self._chunks is not None:
                    self._chunks.reset()  # the file's cells are exact
            else:
                store.notice("prompt cache: llama.cpp refused a state file; prefilling instead")
                start = 0
        save_at = prompt_cache.exact_save_point(len(prompt_ids), start, REPLAY)
        if save_at and not (self._chunks is not None and self._chunks.lossy_below(start)):  # exact KV only
            self.llm.n_tokens = start  # eval removes the cells from here on before decoding
            self.llm.eval(prompt_ids[start:save_at])
            try:
                llama_prompt_cache.save(store, self.llm, prompt_ids[:save_at], self.held_bytes(save_at))
            except OSError as exc:
                store.notice(f"prompt cache: could not write ({exc.strerror or exc}); continuing without")

    def _tokens(self, prompt_ids: list[int], params: GenerationParams, clock: StatsClock):
        self._disk_prefix(prompt_ids, clock)
        self._reuse_chunks(prompt_ids, clock)
        if params.seed is not None:
            from localctx.backends.llamacpp.batch import llama_seed  # the batch decoder: not on the plain path

            self.llm.set_seed(llama_seed(params.seed))  # a 32-bit seed: folded, never truncated
        rules = None
        if params.constraint:
            from localctx.backends.llamacpp import grammar

            rules = grammar.llama_grammar(params.constraint)
        if self._shift:  # sinks + window: streams past n_ctx through llama.cpp's context shift
            yield from self._shift.tokens(prompt_ids, params.top_k, params.top_p, params.temperature, rules)
            return "stop"
        if self._chunks is None:  # llama-cpp-python's generate replays one token; REPLAY are evaluated again
            self.llm.n_tokens = min(int(self.llm.n_tokens), self._cached_prefix(prompt_ids))
        for token in self.llm.generate(prompt_ids, top_k=params.top_k, top_p=params.top_p, min_p=0.0,
                                       temp=params.temperature, repeat_penalty=1.0, grammar=rules):
            yield token
            if self.llm.n_tokens >= self.plan.context:
                return "context"
        return "stop"

    def _prefill(self, prompt_ids: list[int]) -> None:
        """Evaluate what of the prompt is not cached (llama-cpp-python's own prefix rule)."""
        if self._shift:
            self._shift.prefill(prompt_ids)
            return
        cached = self._cached_prefix(prompt_ids)
        if cached == 0:
            self.llm.reset()
        self.llm.n_tokens = cached  # eval removes the cells from here on before decoding
        self.llm.eval(prompt_ids[cached:])

    def verify_rows(self) -> int:
        """Rows a verify batch may have and give one-token decoding's logits bit for bit here
        (speculate.exact_rows), and what a verify step of each length costs with this model and KV
        (prompt lookup's prior, before the calibration's fp16 figure): remembered, else measured once
        and remembered."""
        if self.exact_rows is None:
            from localctx.backends.llamacpp.speculate import ProbeTimes, exact_rows  # prompt lookup only

            key = self._rows_key(self.settings.flash_attn)
            rows, costs = reuse_probe.cached(key, "verify-rows"), reuse_probe.cached(key, "verify-cost")
            if rows is None or (costs is None and rows >= 2):  # costs only matter where a draft may run
                times = ProbeTimes()
                rows = exact_rows(self.llm, times=times)
                costs = {str(t): c for t, c in times.costs().items() if t <= rows}
                reuse_probe.remember(key, rows, "verify-rows")
                reuse_probe.remember(key, costs, "verify-cost")
            self.exact_rows = rows
            if costs:
                self.verify_cost = verify_costs(costs)
        return self.exact_rows

    def _drafted_tokens(self, prompt_ids: list[int], params: GenerationParams, clock: StatsClock):
        self._disk_prefix(prompt_ids, clock)
        self._reuse_chunks(prompt_ids, clock)
        self._prefill(prompt_ids)
        from localctx.backends.llamacpp.speculate import LlamaCppVerifier, last_logits  # prompt lookup only

        # a verify batch stays inside the context allocated now (fit() made room for the prompt and answer)
        verifier = LlamaCppVerifier(self.llm, min(self.plan.context, int(self.llm.n_ctx())), self._shift)
        try:
            rows = clock.verify_exact_rows = self.verify_rows()
            tokens = speculation.speculative_tokens(verifier, prompt_ids, last_logits(self.llm), params, clock,
                                                   max_draft=rows - 1, verify_cost=self.verify_cost)
            for token in tokens:
                yield token
                if not self._shift and self.llm.n_tokens >= self.plan.context:
                    return "context"
        finally:
            verifier.close()

    def generate(self, prompt: Prompt, params: GenerationParams = GenerationParams(),
                 cancel: threading.Event | None = None) -> Iterator[GenerationEvent]:
        ids = self.tokenize(prompt)
        params = with_template_stops(prompt, params, self.template.stops)
        check_prompt_fits(len(ids), self.plan, self.spec, params.max_tokens)
        speculate = speculation.resolve(params.speculate, self.plan.policy, batch_differs=True,
                                        constrained=params.constraint is not None)
        self.fit(len(ids) + params.max_tokens, ids)
        cached = self._shift.cached_prefix(ids) if self._shift else self._cached_prefix(ids)
        clock = StatsClock(backend="llamacpp", policy=str(self.plan.policy), prompt_tokens=len(ids),
                           cached_tokens=cached, speculate=speculate)
        drafted = clock.speculate == "ngram"
        if drafted and self.verify_rows() < 2:  # a draft would change the text: plain decoding, said so
            clock.verify_exact_rows = self.exact_rows
            clock.speculate, drafted = f"off ({speculation.NO_EXACT_ROWS})", False
        source = self._drafted_tokens(ids, params, clock) if drafted else self._tokens(ids, params, clock)
        yield from stream(source,
                          token_bytes=lambda t: self.llm.detokenize([t], special=False), eos=self.eog,
                          params=params, clock=clock, probe=KVProbe(self.kv_state), cancel=cancel)

    def generate_batch(self, prompts, params: GenerationParams = GenerationParams(),
                       cancel: threading.Event | None = None):
        from localctx.backends.llamacpp.batch import generate_batch  # several sequences, one llama.cpp context

        return generate_batch(self, prompts, params, cancel)

