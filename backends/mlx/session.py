"""``--backend mlx``: Apple Silicon through MLX (Linux CPU runs it too, slowly, for tests).

The model graph is mlx-lm's for its architecture (zoo.py, with localctx's policy cache through the cache
object mlx-lm's models call: lm_cache.py) or localctx's own page (llama.py, gemma3.py, with policy_cache.py)
where the policy needs it (``zoo.graph_for``). Either is called as ``model(tokens, cache, last_only)``."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import numpy as np

from localctx.backends.base import (GenerationEvent, GenerationParams, OutputConstraint, Prompt, Session,
                                    StatsClock, check_prompt_fits, with_template_stops)
from localctx.backends.generation import speculation
from localctx.backends.generation.decode_loop import KVProbe, stream
from localctx.backends.mlx import prompt_cache as mlx_prompt_cache
from localctx.backends.mlx.loading import LoadedModel, LoadOptions
from localctx.backends.mlx.lm_cache import NativeCache
from localctx.backends.mlx.sampling import Sampler
from localctx.backends.mlx.speculate import MLXVerifier
from localctx.backends.mlx.tokenizer import Tokenizer
from localctx.backends.mlx.zoo import LMModel
from localctx.kvcache import prompt_cache
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.prompt_cache import PromptCache
from localctx.kvcache.model_spec import ModelSpec


@dataclass(frozen=True)
class SessionOptions:
    """``prefill_chunk``: prompt tokens per forward pass. Queries in a chunk see the chunk's own
    tokens at full precision and nothing is evicted mid-chunk; 1 streams every token through the
    policy exactly as decoding does (what quality evaluation wants)."""
    prefill_chunk: int = 256
    load: LoadOptions = LoadOptions()
    graph: str = "auto"  # "page" (llama.py / gemma3.py), "mlx-lm" (zoo.py) or "auto" (zoo.graph_for)


class MLXSession(Session):
    def __init__(self, loaded: LoadedModel | LMModel, tokenizer: Tokenizer, spec: ModelSpec, plan: Plan,
                 options: SessionOptions = SessionOptions()):
        """``loaded``: a page's model (loading.py) or an mlx-lm model (zoo.py); either is called as
        ``loaded(tokens, cache, last_only)`` and makes its own cache for the plan's policy."""
        self.spec, self.plan, self.backend_name = spec, plan, "mlx"
        self.decode_threads = 1 if mx.metal.is_available() else None  # MLX's CPU kernels and BLAS take every core
        self.model, self.tokenizer, self.options = loaded, tokenizer, options
        self.cache = loaded.make_cache(plan.policy, spec)
        self.fed: list[int] = []
        self.last_logits: np.ndarray | None = None
        self._record_allocation()

    def _record_allocation(self) -> None:
        """MLX allocates as the cache fills (MLXBackend.kv_reserved_at_load): the plan says what the
        buffers take now, as it does after a llama.cpp context grows, for the stats line, --json and the
        chat's panel."""
        tokens, kv_bytes = self.cache.allocated()
        self.plan.grow_to(min(tokens, self.plan.context), kv_bytes)  # a buffer's step may pass a small context

    def _probe(self) -> tuple[int, int, int]:
        self._record_allocation()
        return self.cache.probe()

    # -- prompt handling ---------------------------------------------------------------
    def render(self, prompt: Prompt) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.template.render(prompt)

    def count_tokens(self, prompt: Prompt) -> int:
        return len(self.tokenizer.encode(self.render(prompt)))

    def reset(self) -> None:
        self.cache.reset()
        self.fed, self.last_logits = [], None
        self._record_allocation()

    def close(self) -> None:
        """Releases the cache and the model; the plan keeps what the last answer allocated (run's stats line)."""
        self.cache.reset()
        self.fed, self.last_logits = [], None
        self.model = None

    def feed(self, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` through the model and cache; logits of the last token (or of each)."""
        if self.model is None:
            raise UserError("this MLX session is closed; load the model again")
        chunk = max(1, self.options.prefill_chunk)
        outs, start = [], 0
        while start < len(tokens):
            part = tokens[start:start + self.cache.chunk_length(min(chunk, len(tokens) - start))]
            start += len(part)
            before = self.cache.snapshot()
            try:
                logits = self.model(mx.array(part, dtype=mx.int32), self.cache, last_only=not all_logits)
                mx.eval(logits, *self.cache.arrays())
            except BaseException:  # a layer raised, or the evaluation did: no layer keeps this chunk
                self.cache.restore(before)
                self.last_logits = None  # the cache now ends where ``fed`` does, with no logits for it
                if self.cache.n_seen != len(self.fed):  # mlx-lm's own caches restart instead
                    self.reset()
                raise
            outs.append(np.array(logits))
            self.fed.extend(part)
        self.last_logits = outs[-1] if not all_logits else outs[-1][-1]
        return np.concatenate(outs) if all_logits else outs[-1]

    def _plan_feed(self, tokens: list[int]) -> tuple[list[int], int]:
        """(tokens still to run, tokens reused from the cache). The cache grows by appending; it
        rolls back to a shared prefix only where that is exact (cache.truncate), else restarts."""
        n = len(self.fed)
        if n and tokens[:n] == self.fed and (len(tokens) > n or self.last_logits is not None):
            return tokens[n:], n
        common = 0
        for a, b in zip(self.fed, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # at least one token runs, for the next logits
        if common > 0 and self.cache.truncate(common):
            self.fed = self.fed[:common]
            return tokens[common:], common
        self.reset()
        return tokens, 0

    # -- greedy decoding, pipelined as mlx-lm's generate_step ------------------------------------
    def _greedy(self, logits: np.ndarray, n: int) -> Iterator[int]:
        """Up to ``n`` greedy tokens after ``logits``. The step that feeds a token is queued
        (``mx.async_eval``) before the token is read back, so building one step's graph overlaps
        computing the last; the token stays on the device in between. A step queued for a token
        the stream then did not take (end of text, a stop string) is undone, so the cache ends
        where ``fed`` does, as after ``feed``; a step that fails restarts the conversation."""
        y = mx.array([int(np.argmax(logits))], dtype=mx.int32)
        queued = None
        try:
            for left in range(n - 1, -1, -1):
                queued = self._queue(y) if left else None  # no step for the last token asked for
                tok = int(y.item())
                if queued is not None:
                    self.fed.append(tok)
                yield tok
                if queued is None:
                    self.last_logits = np.array(logits)
                    return
                y, logits, queued = queued.next, queued.logits, None
        except GeneratorExit:
            if queued is not None:
                self._unqueue(queued)
            self.last_logits = np.array(logits)
            raise
        except BaseException:
            self.reset()
            raise

    def _queue(self, y: mx.array) -> "_Queued":
        if self.model is None:
            raise UserError("this MLX session is closed; load the model again")
        before = self.cache.snapshot()
        logits = self.model(y, self.cache, last_only=True)
        nxt = mx.argmax(logits).astype(mx.int32).reshape(1)
        mx.async_eval(nxt, logits, *self.cache.arrays())
        return _Queued(before, logits, nxt)

    def _unqueue(self, queued: "_Queued") -> None:
        self.fed.pop()
        if self.cache.kind == NativeCache.kind:  # mlx-lm's own caches trim where they can
            if not self.cache.truncate(len(self.fed)):
                self.reset()
        else:
            self.cache.restore(queued.before)

    # -- the prompt cache on disk (backends/mlx/prompt_cache.py) --------------------------------
    def enable_prompt_cache(self, model_path: Path) -> str | None:
        if not Path(model_path).is_file():
            return "the prompt cache keys on a single model file; this model is a folder"
        if self.cache.kind == NativeCache.kind:
            return f"mlx-lm's own caches for {self.spec.architecture} (sliding or recurrent layers) are not saved to disk"
        policy, cache = str(self.plan.policy), self.cache
        self.prompt_cache = PromptCache(lambda: mlx_prompt_cache.scope(prompt_cache.model_hash(model_path), policy, cache))
        return None

    def _load_from_disk(self, tokens: list[int], reused: int, clock: StatsClock) -> int:
        """Replace the cache with a file's when that reuses more of ``tokens`` (a file is used whole:
        this cache cannot be cut back exactly in general); returns the tokens now cached."""
        hit = self.prompt_cache.lookup(tokens, len(tokens) - 1, whole_only=True)
        if hit is None or hit.n_tokens <= reused:
            return reused
        try:
            mlx_prompt_cache.load(self.cache, hit)
        except ValueError as exc:
            self.reset()
            self.prompt_cache.notice(f"prompt cache: {hit.file.path.name} does not fit this cache ({exc}); prefilling")
            clock.cached_tokens = 0
            return 0
        self.fed, self.last_logits = list(tokens[:hit.n_tokens]), None
        clock.cached_tokens = clock.loaded_tokens = hit.n_tokens
        return hit.n_tokens

    def _prefill(self, tokens: list[int], todo: list[int], clock: StatsClock) -> np.ndarray:
        """Feeds ``todo`` (the end of ``tokens``), first from a prompt-cache file where one covers
        more, saving the prompt's cache at its last chunk boundary on the way."""
        if self.prompt_cache is None:
            return self.feed(todo) if todo else self.last_logits
        start = self._load_from_disk(tokens, len(tokens) - len(todo), clock)
        save_at = prompt_cache.save_point(len(tokens), start)
        if save_at:
            self.feed(tokens[start:save_at])
            start = save_at
            try:
                mlx_prompt_cache.save(self.prompt_cache, self.cache, tokens[:save_at])
            except OSError as exc:  # a full or read-only disk costs the cache, not the answer
                self.prompt_cache.notice(f"prompt cache: could not write ({exc.strerror or exc}); continuing without")
        return self.feed(tokens[start:]) if start < len(tokens) else self.last_logits

    # -- structured output (backends/generation/guided.py) ------------------------------------
    def tool_format(self):
        return self.tokenizer.template.tool_format

    def constraint_refusal(self, constraint: OutputConstraint) -> str | None:
        return self.tokenizer.guides.refusal(constraint)

    def generate(self, prompt: Prompt, params: GenerationParams = GenerationParams(),
                 cancel: threading.Event | None = None) -> Iterator[GenerationEvent]:
        tokens = self.tokenizer.encode(self.render(prompt))
        params = with_template_stops(prompt, params, self.tokenizer.template.stops)
        check_prompt_fits(len(tokens), self.plan, self.spec, params.max_tokens)
        limit = self.cache.position_limit
        if limit is not None and self.plan.policy.evicts and len(tokens) + params.max_tokens > limit:
            raise UserError(f"mlx-lm's {self.spec.architecture} rotates keys at their stream positions, so "
                            f"--kv {self.plan.policy} streams only to the trained context ({limit:,} tokens), "
                            f"not {len(tokens):,} + {params.max_tokens:,}; lower --max-tokens or the prompt")
        if not self.plan.policy.evicts:
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens, self.plan.context - len(tokens)))
        todo, cached = self._plan_feed(tokens)
        clock = StatsClock(backend="mlx", policy=str(self.plan.policy), prompt_tokens=len(tokens),
                           cached_tokens=cached, speculate=speculation.resolve(
                               params.speculate, self.plan.policy, constrained=params.constraint is not None))
        sampler = Sampler(params, self.tokenizer.guides.guide(params.constraint) if params.constraint else None)

        def ids() -> Iterator[int]:
            logits = self._prefill(tokens, todo, clock)
            if params.temperature <= 0 and params.constraint is None:  # greedy: pipelined
                yield from self._greedy(logits, params.max_tokens)
                return
            while True:
                tok = sampler(logits)
                yield tok
                logits = self.feed([tok])

        def drafted_ids() -> Iterator[int]:
            first = self._prefill(tokens, todo, clock)
            verifier = MLXVerifier(self, None if self.plan.policy.evicts else self.plan.context)
            yield from speculation.speculative_tokens(verifier, tokens, first, params, clock)

        source = drafted_ids() if clock.speculate == "ngram" else ids()
        yield from stream(source, token_bytes=self.tokenizer.token_bytes, eos=self.tokenizer.eos, params=params,
                          clock=clock, probe=KVProbe(self._probe), cancel=cancel)


@dataclass
class _Queued:
    """A greedy step in flight: the cache before it, its logits and the token they choose."""
    before: object
    logits: mx.array
    next: mx.array
