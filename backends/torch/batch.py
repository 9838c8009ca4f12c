"""Batched generation: several independent prompts decoded together, one forward per step for
all of them (the weights are read once per step for the whole batch).

Sequences are admitted while the pool can hold their prompt plus their answer (the blocks they
may need are reserved up front, so a running batch never runs out of blocks); each is
prefilled alone, then joins the decode batch; a finished sequence frees its blocks and the
next waiting one is admitted (continuous batching). Each sequence runs through the shared
``stream`` loop, so stops, limits, cancellation and UTF-8 work exactly as for one prompt."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

from localctx.backends.base import GenerationEvent, GenerationParams, Prompt, StatsClock, with_template_stops
from localctx.backends.generation.decode_loop import stream
from localctx.backends.torch.sampling import Sampler
from localctx.kvcache.errors import UserError

if TYPE_CHECKING:
    from localctx.backends.torch.session import TorchSession


@dataclass
class BatchItem:
    index: int
    seq_id: int
    ids: list[int]
    params: GenerationParams
    blocks: int  # blocks reserved for prompt + answer
    sampler: Sampler = field(init=False)
    pending: int = -1  # the token the stream takes next
    events: Iterator[GenerationEvent] | None = None

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params)


class BatchRun:
    def __init__(self, session: "TorchSession", prompts: Sequence[Prompt], params: GenerationParams,
                 cancel: threading.Event | None):
        self.session = session
        self.engine = session.engine
        self.cache = session.engine.cache
        self.cancel = cancel
        pool = self.cache.pool
        self.items: list[BatchItem] = []
        for i, prompt in enumerate(prompts):
            ids = session.tokenize(prompt)
            try:
                p = session.capped(len(ids), with_template_stops(prompt, params, session.template.stops))
            except UserError as exc:
                raise UserError(f"prompt {i + 1} of {len(prompts)}: {exc}") from None
            blocks = pool.blocks_for(len(ids) + p.max_tokens)
            if blocks > pool.n_blocks:
                raise UserError(f"prompt {i + 1} of {len(prompts)} needs {len(ids) + p.max_tokens:,} tokens of KV, more "
                                f"than the pool's {pool.capacity_tokens:,}; give a larger --context or fewer --max-tokens")
            self.items.append(BatchItem(i, 1 + i, ids, p, blocks))

    def _tokens(self, item: BatchItem) -> Iterator[int]:
        logits = self.engine.prefill(item.seq_id, item.ids)
        item.pending = item.sampler.sample(logits)
        while True:
            yield item.pending  # the driver feeds it and samples the next one before asking again

    def _admit(self, item: BatchItem) -> GenerationEvent:
        # the blocks for prompt + answer are set aside now, consecutive where possible
        self.cache.add_sequence(item.seq_id, reserve_tokens=len(item.ids) + item.params.max_tokens)
        clock = StatsClock(backend="torch", policy=str(self.session.plan.policy), prompt_tokens=len(item.ids))
        tok = self.session.tokenizer
        item.events = stream(self._tokens(item), token_bytes=tok.token_bytes, eos=tok.eos_ids, params=item.params,
                             clock=clock, probe=self.session.kv_probe(item.seq_id), cancel=self.cancel)
        return next(item.events)

    def _finish(self, item: BatchItem) -> None:
        if self.cache.has(item.seq_id):
            self.cache.finish(item.seq_id)

    def events(self) -> Iterator[tuple[int, GenerationEvent]]:
        waiting = deque(self.items)
        active: list[BatchItem] = []
        try:
            while waiting or active:
                while waiting and waiting[0].blocks <= self.cache.pool.free_blocks:
                    item = waiting.popleft()
                    event = self._admit(item)
                    yield item.index, event
                    if event.kind == "done":
                        self._finish(item)
                    else:
                        active.append(item)
                if not active:
                    continue
                logits = self.engine.decode([it.seq_id for it in active], [it.pending for it in active])
                for item, row in zip(active, logits):
                    item.pending = item.sampler.sample(row)
                still = []
                for item in active:
                    event = next(item.events)
                    yield item.index, event
                    if event.kind == "done":
                        self._finish(item)
                    else:
                        still.append(item)
                active = still
        finally:
            for item in self.items:
                if item.events is not None:
                    item.events.close()
                self._finish(item)
