"""TorchSession: a loaded model with its paged KV cache, behind the foundation's Session contract.

The conversation lives in cache sequence 0. A new prompt that extends what is cached only
prefills the new suffix (the reused prefix is reported as ``cached_tokens``)."""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from localctx.backends.generation import speculation
from localctx.backends.base import (GenerationEvent, GenerationParams, OutputConstraint, Prompt, Session,
                                    StatsClock, check_prompt_fits, with_template_stops)
from localctx.backends.models.chat_template import ChatTemplate
from localctx.backends.generation.slots import common_prefix
from localctx.backends.generation.decode_loop import KVProbe, stream
from localctx.backends.torch.engine import Engine
from localctx.backends.torch.sampling import Sampler
from localctx.backends.torch import prompt_cache as torch_prompt_cache
from localctx.backends.torch.speculate import TorchVerifier
from localctx.backends.torch.tokenizer import TextTokenizer
from localctx.kvcache import cost, growth, prompt_cache
from localctx.kvcache.errors import UserError
from localctx.kvcache.paged import PagedKVCache
from localctx.kvcache.plan import Plan
from localctx.kvcache.prompt_cache import PromptCache
from localctx.kvcache.model_spec import ModelSpec

CONVERSATION = 0


def export_held(cache, seq_id: int, n_tokens: int) -> dict[str, torch.Tensor]:
    """A sequence's first ``n_tokens`` of K/V as the cache's import_sequence takes it (a policy cache
    exports all it holds)."""
    if isinstance(cache, PagedKVCache):
        return cache.export_sequence(seq_id, n_tokens)
    return cache.export_sequence(seq_id)


class TorchSession(Session):
    backend_name = "torch"

    def __init__(self, engine: Engine, tokenizer: TextTokenizer, spec: ModelSpec, plan: Plan, options=None):
        """``options``: the TorchOptions it was built with (serve builds sessions with other KV
        policies on the same model with them: app/serve/lane_makers.TorchLanes)."""
        self.engine = engine
        self.options = options
        self.tokenizer = tokenizer
        self.spec = spec
        self.plan = plan
        self.template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_text, tokenizer.eos_text)
        self.history: list[int] = []  # tokens held in the conversation's cache, oldest first
        # a cache of room for n tokens, where the plan lets this session grow (loading.build_session)
        self.resize: Callable[[int], object] | None = None
        self.engine_lock = threading.Lock()  # held while the engine runs (serving.SlotBatcher holds it too)
        self.decode_threads = torch.get_num_threads() if engine.device == "cpu" else 1

    # -- prompts --------------------------------------------------------------------------
    def render(self, prompt: Prompt) -> str:
        return prompt if isinstance(prompt, str) else self.template.render(prompt)

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(self.render(prompt))

    def count_tokens(self, prompt: Prompt) -> int:
        return len(self.tokenize(prompt))

    def capped(self, n_prompt: int, params: GenerationParams) -> GenerationParams:
        """Refuse prompts that do not fit; generation stops ('length') where the context ends."""
        check_prompt_fits(n_prompt, self.plan, self.spec, params.max_tokens)
        if self.plan.policy.evicts:
            return params  # a windowed cache streams on past the context at fixed memory
        room = self.plan.context - n_prompt
        if room < params.max_tokens:
            return dataclasses.replace(params, max_tokens=room)
        return params

    # -- structured output (backends/generation/guided.py) ---------------------------------
    def tool_format(self):
        return self.template.tool_format

    def constraint_refusal(self, constraint: OutputConstraint) -> str | None:
        return self.tokenizer.guides.refusal(constraint)

    def sampler(self, params: GenerationParams) -> Sampler:
        """The sampler for one answer, under its constraint's grammar where it has one."""
        return Sampler(params, self.tokenizer.guides.guide(params.constraint) if params.constraint else None)

    # -- the cache ------------------------------------------------------------------------
    def kv_probe(self, seq_id: int) -> KVProbe:
        cache = self.engine.cache

        def read() -> tuple[int, int, int]:
            if not cache.has(seq_id):
                return 0, 0, 0
            return cache.kv_bytes(seq_id), cache.kv_tokens(seq_id), 0
        return KVProbe(read)

    def fit(self, needed: int) -> None:
        """Grows the cache to hold ``needed`` tokens, the conversation's K/V moved into it (grow_cache)."""
        self.grow_cache(needed, {CONVERSATION: len(self.history)} if self.history else {})

    def grow_cache(self, needed: int, held: dict[int, int]) -> bool:
        """Grows the cache toward the plan's context when ``needed`` tokens do not fit (kvcache/growth.py:
        at least doubling, in whole blocks): a larger cache is made and the K/V of each sequence of
        ``held`` (seq id: its tokens) moved into it; the plan then says what is allocated. Returns
        whether it grew. The conversation's (``fit``) and a server's slots' (serving.SlotBatcher)."""
        cache = self.engine.cache
        have, most = cache.pool.capacity_tokens, self.plan.context
        if self.resize is None or not growth.must_grow(have, needed, most):
            return False
        n = growth.next_size(have, needed, most, cache.pool.block_size)
        grown = self.resize(n)
        with self.engine_lock:
            for seq_id, n_tokens in held.items():
                if cache.has(seq_id):
                    grown.import_sequence(seq_id, export_held(cache, seq_id, n_tokens))
            self.engine.cache = grown
        self.plan.grow_to(n, cost.max_kv_bytes(self.spec, self.plan.policy, n))
        return True

    def reset(self) -> None:
        if self.engine.cache is not None and self.engine.cache.has(CONVERSATION):
            self.engine.cache.finish(CONVERSATION)
        self.history = []

    def release_kv(self) -> None:
        """Frees the KV pool (serve closing an idle lane); the session still tokenizes, nothing more."""
        self.reset()
        self.engine.cache = None

    def close(self) -> None:
        self.reset()

    # -- the prompt cache on disk ---------------------------------------------------------
    def enable_prompt_cache(self, model_path: Path) -> str | None:
        if not model_path.is_file():
            return "the prompt cache keys on a single model file; this model is a folder"
        policy, cache = str(self.plan.policy), self.engine.cache
        self.prompt_cache = PromptCache(lambda: torch_prompt_cache.scope(prompt_cache.model_hash(model_path), policy, cache))
        return None

    def _load_from_disk(self, ids: list[int], reused: int, clock: StatsClock) -> int:
        """Replace the conversation's cache with a file's when that reuses more of ``ids``;
        returns the tokens now cached."""
        if self.prompt_cache is None:
            return reused
        cache = self.engine.cache
        hit = torch_prompt_cache.lookup(self.prompt_cache, cache, ids, len(ids) - 1)
        if hit is None or hit.n_tokens <= reused:
            return reused
        cache.finish(CONVERSATION)
        torch_prompt_cache.load(cache, CONVERSATION, hit)
        self.history[:] = ids[:hit.n_tokens]
        clock.cached_tokens = clock.loaded_tokens = hit.n_tokens
        return hit.n_tokens

    def _save_to_disk(self, tokens: list[int]) -> None:
        try:
            torch_prompt_cache.save(self.prompt_cache, self.engine.cache, CONVERSATION, tokens)
        except OSError as exc:  # a full or read-only disk costs the cache, not the answer
            self.prompt_cache.notice(f"prompt cache: could not write ({exc.strerror or exc}); continuing without")

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: GenerationParams = GenerationParams(),
                 cancel: threading.Event | None = None) -> Iterator[GenerationEvent]:
        ids = self.tokenize(prompt)
        params = self.capped(len(ids), with_template_stops(prompt, params, self.template.stops))
        self.fit(len(ids) + params.max_tokens)
        cache = self.engine.cache
        if not cache.has(CONVERSATION):
            cache.add_sequence(CONVERSATION)
            self.history = []
        reused = min(common_prefix(self.history, ids), len(ids) - 1)  # at least one token is prefilled
        if not cache.can_truncate(CONVERSATION, reused):
            reused = 0  # a quantized or evicted prefix cannot be cut back: prefill again
        cache.truncate(CONVERSATION, reused)
        self.history = self.history[:reused]
        clock = StatsClock(backend="torch", policy=str(self.plan.policy), prompt_tokens=len(ids),
                           cached_tokens=reused, speculate=speculation.resolve(
                               params.speculate, self.plan.policy, constrained=params.constraint is not None))
        sampler = self.sampler(params)

        def prefill() -> torch.Tensor:
            start = self._load_from_disk(ids, reused, clock)
            save_at = torch_prompt_cache.save_point(cache, len(ids), start) if self.prompt_cache is not None else 0
            try:
                if save_at:  # the prompt's cache (all but its last token, or to a chunk boundary) goes to disk
                    self.engine.prefill(CONVERSATION, ids[start:save_at])
                    self.history.extend(ids[start:save_at])
                    start = save_at
                    self._save_to_disk(ids[:save_at])
                logits = self.engine.prefill(CONVERSATION, ids[start:])
            except BaseException:
                keep = len(self.history) if cache.can_truncate(CONVERSATION, len(self.history)) else 0
                cache.truncate(CONVERSATION, keep)  # keep cache and history in step
                del self.history[keep:]
                raise
            self.history.extend(ids[start:])
            return logits

        def drafted_tokens() -> Iterator[int]:
            with self.engine_lock:
                first = prefill().float().cpu().numpy()
                # a verify step stays inside the cache allocated now (fit() made room for the prompt and answer)
                limit = None if self.plan.policy.evicts else min(self.plan.context, cache.pool.capacity_tokens)
                verifier = TorchVerifier(self.engine, CONVERSATION, self.history, limit)
                yield from speculation.speculative_tokens(verifier, ids, first, params, clock)

        def tokens() -> Iterator[int]:
            with self.engine_lock:
                logits = prefill()
                while True:
                    tok = sampler.sample(logits)
                    yield tok
                    logits = self.engine.decode([CONVERSATION], [tok])[0]
                    self.history.append(tok)

        source = drafted_tokens() if clock.speculate == "ngram" else tokens()
        yield from stream(source, token_bytes=self.tokenizer.token_bytes, eos=self.tokenizer.eos_ids,
                          params=params, clock=clock, probe=self.kv_probe(CONVERSATION), cancel=cancel)

    def generate_batch(self, prompts: Sequence[Prompt], params: GenerationParams = GenerationParams(),
                       cancel: threading.Event | None = None) -> Iterator[tuple[int, GenerationEvent]]:
        from localctx.backends.torch.batch import BatchRun

        if not prompts:
            raise UserError("generate_batch needs at least one prompt")
        self.reset()  # the batch needs the pool; the conversation is forgotten, as the contract says
        with self.engine_lock:
            yield from BatchRun(self, prompts, params, cancel).events()
