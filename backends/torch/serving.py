"""Continuous batching for a server: conversation slots on one paged KV pool.

Each slot is a cache sequence that outlives its request: it keeps the tokens it holds
(``history``), so a follow-up request that extends the same conversation keeps the longest
common prefix and prefills only the rest. Live streams are decoded together, one forward per
step for all of them (the weights are read once per step), and join and leave between steps.
Prompts are prefilled between those steps, at most one prefill chunk (``prefill_chunk`` tokens) a
step: streams that join together and fit in it are prefilled together (``Engine.prefill_together``:
one forward for prompts of similar length), a longer prompt a chunk per step, so a long prompt
delays the streams that decode beside it by one chunk a step, never by its whole prefill.

Memory never runs out mid-generation: a stream is admitted only while the worst case of every
live stream (prompt + max answer, capped at what the KV policy ever holds) plus what the idle
slots hold fits the pool; a pool smaller than the plan's context first grows toward it (every
slot's K/V moved into a larger one, kvcache/growth.py), then idle slots' histories are dropped,
least recently used first, to make room. A request that could never fit is refused (UserError); one that does not fit now waits.
Each stream runs through the shared ``stream`` loop (stops, limits, UTF-8, cancellation). A
stream's own failure (its sampler, its prefill) ends it alone; a failed decode forward ends the
streams it decoded; either way their slots are free again (backends/generation/slots.py)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from localctx.backends.generation.slots import Slot, SlotStreams, choose_slot
from localctx.backends.generation.stream_source import StreamFailed
from localctx.backends.base import GenerationEvent, GenerationParams, Prompt, StatsClock, with_template_stops
from localctx.backends.generation.decode_loop import KVProbe, stream
from localctx.backends.torch.sampling import Sampler
from localctx.kvcache.errors import UserError

if TYPE_CHECKING:
    from localctx.backends.torch.session import TorchSession

FIRST_SLOT_ID = 1000  # cache sequence ids of the slots (the session's own conversation is 0)


@dataclass
class LiveStream:
    slot: Slot
    ids: list[int]
    reused: int
    params: GenerationParams
    worst_blocks: int
    sampler: Sampler
    cancel: threading.Event | None = None
    events: Iterator[GenerationEvent] | None = None  # None until the step that ends its prefill
    pending: int = -1  # sampled, not yet decoded into the cache
    prefilled: int = 0  # prompt tokens in its slot's cache so far (from ``reused``)
    prefill_started: float | None = None  # perf_counter when its first prefill chunk ran


class SlotBatcher(SlotStreams):
    """``start`` a request (its slot and memory; the first event comes from a later ``step``) or
    get None when it must wait; ``step`` prefills at most ``prefill_chunk`` prompt tokens of the
    streams that joined (oldest first), decodes every other live stream once, and returns each
    one's next event (a stream whose prefill ended: its first)."""

    session: "TorchSession"
    live: list[LiveStream]

    def __init__(self, session: "TorchSession", n_slots: int):
        super().__init__(session, [Slot(FIRST_SLOT_ID + i) for i in range(n_slots)])
        self.engine = session.engine
        self.growths = 0  # times the pool grew toward the plan's context
        session.reset()  # the session's own conversation would hold blocks the slots need
        self.prefill_chunk = self.engine.options.prefill_chunk
        self.prefill_steps: list[int] = []  # prompt tokens prefilled in each step that prefilled (the last 64)
        self._waiting_prompt: Prompt | None = None
        self._waiting_ids: list[int] = []
        self._lock = session.engine_lock  # the session's own generate/generate_batch must not run meanwhile

    # -- memory ----------------------------------------------------------------------------
    @property
    def cache(self):
        return self.engine.cache  # a new, larger one after the pool grows (_grow)

    @property
    def pool(self):
        return self.engine.cache.pool

    def _most_blocks(self) -> int:
        """Blocks the pool may hold: the plan's context where the session grows its cache, else what it has."""
        if self.session.resize is None:
            return self.pool.n_blocks
        return max(self.pool.n_blocks, self.pool.blocks_for(self.session.plan.context))

    def _grow(self, blocks: int) -> None:
        """Grows the pool toward the plan's context to hold ``blocks`` (kvcache/growth.py), every slot's
        cached K/V moved into the larger cache (TorchSession.grow_cache): live streams decode on, idle
        conversations keep their prefixes."""
        held = {s.seq_id: self.cache.length(s.seq_id) for s in self.slots if self.cache.has(s.seq_id)}
        if self.session.grow_cache(blocks * self.pool.block_size, held):
            self.growths += 1

    def _held_blocks(self, n_tokens: int) -> int:
        policy = self.session.plan.policy
        cap = policy.capacity()
        held = n_tokens if cap is None else min(n_tokens, cap + policy.group_size)
        return self.pool.blocks_for(held)

    def _slot_blocks(self, slot: Slot) -> int:
        return len(self.pool.block_table(slot.seq_id)) if self.cache.has(slot.seq_id) else 0

    def _forget(self, slot: Slot) -> None:
        if self.cache.has(slot.seq_id):
            self.cache.finish(slot.seq_id)
        slot.history = []

    def _in_step(self, live: LiveStream) -> bool:
        seq_id = live.slot.seq_id
        return self.cache.has(seq_id) and self.cache.length(seq_id) == len(live.slot.history)

    # -- admission -------------------------------------------------------------------------
    def start(self, prompt: Prompt, params: GenerationParams, cancel: threading.Event | None,
              ids: list[int] | None = None) -> tuple[LiveStream, None] | None:
        if ids is None:
            if self._waiting_prompt is not prompt:  # a request that waits is asked again every step
                self._waiting_prompt, self._waiting_ids = prompt, self.session.tokenize(prompt)
            ids = self._waiting_ids
        # UserError when the prompt cannot fit; a transcript's next question ends the answer, as in generate
        params = self.session.capped(len(ids), with_template_stops(prompt, params, self.session.template.stops))
        worst = self._held_blocks(len(ids) + params.max_tokens)
        most = self._most_blocks()
        if worst > most:
            raise UserError(f"the prompt ({len(ids):,} tokens) plus max_tokens ({params.max_tokens:,}) needs more KV "
                            f"than the server's pool of {most * self.pool.block_size:,} tokens; lower max_tokens or "
                            f"shorten the prompt")
        choice = choose_slot(self.slots, ids)
        if choice is None:
            return None
        slot, shared = choice
        committed = sum(s.worst_blocks for s in self.live)
        idle = sorted((s for s in self.slots if not s.busy and s is not slot), key=lambda s: s.last_used)
        held_idle = sum(self._slot_blocks(s) for s in idle)
        if committed + held_idle + worst > self.pool.n_blocks and self.pool.n_blocks < most:
            self._grow(min(most, committed + held_idle + worst))  # before dropping an idle conversation
        while committed + held_idle + worst > self.pool.n_blocks and idle:
            victim = idle.pop(0)  # least recently used conversation goes first
            held_idle -= self._slot_blocks(victim)
            self._forget(victim)
        if committed + held_idle + worst > self.pool.n_blocks:
            return None  # waits until a live stream finishes
        sampler = self.session.sampler(params)  # grammar too; before the slot is taken: one that fails holds nothing
        with self._lock:
            return self._begin(slot, shared, ids, params, worst, sampler, cancel)

    def _begin(self, slot: Slot, shared: int, ids: list[int], params: GenerationParams, worst: int,
               sampler: Sampler, cancel: threading.Event | None) -> tuple[LiveStream, None]:
        cache = self.cache
        try:
            if not cache.has(slot.seq_id):
                cache.add_sequence(slot.seq_id)
                slot.history = []
            reused = min(shared, len(ids) - 1)  # at least one token is prefilled, for the logits
            if not cache.can_truncate(slot.seq_id, reused):
                reused = 0  # a quantized or evicted prefix cannot be cut back: prefill again
            cache.truncate(slot.seq_id, reused)
            del slot.history[reused:]
        except BaseException:
            self._forget(slot)  # its cache may be half changed: the conversation is not kept
            raise
        slot.busy = True
        live = LiveStream(slot, ids, reused, params, worst, sampler, cancel, prefilled=reused)
        self.live.append(live)
        return live, None  # prefilled by the next steps, with the streams that join with it

    def _probe(self, seq_id: int) -> KVProbe:
        def read() -> tuple[int, int, int]:
            cache = self.cache  # the pool may have grown since the stream started
            if not cache.has(seq_id):
                return 0, 0, 0
            held = cache.kv_tokens(seq_id)
            return cache.kv_bytes(seq_id), held, cache.length(seq_id) - held
        return KVProbe(read)

    def _tokens(self, live: LiveStream) -> Iterator[int]:
        while True:
            yield live.pending  # ``step`` feeds it and samples the next one before asking again

    def _prefill(self, joining: list[LiveStream]) -> tuple[list[LiveStream], list]:
        """Prefills at most ``prefill_chunk`` prompt tokens of the joining streams, oldest first
        (streams whose rest fits go through one ``prefill_together``); samples the first token of
        each whose prompt is now in its cache and starts its event stream (a stream cancelled
        meanwhile starts one too, which ends at once). Returns (streams ready for their first
        event, StreamFailed events of the streams whose prefill failed)."""
        ready = [s for s in joining if s.cancel is not None and s.cancel.is_set()]
        pieces: list[tuple[LiveStream, list[int]]] = []
        budget = self.prefill_chunk
        for s in joining:
            if s in ready or budget == 0:
                continue
            take = min(budget, len(s.ids) - s.prefilled)
            pieces.append((s, s.ids[s.prefilled:s.prefilled + take]))
            budget -= take
        failed: list = []
        if pieces:
            now = time.perf_counter()
            for s, _ in pieces:
                s.prefill_started = s.prefill_started or now
            try:
                rows = self.engine.prefill_together([s.slot.seq_id for s, _ in pieces], [p for _, p in pieces])
            except Exception as exc:  # noqa: BLE001 - these prompts' forward: only their streams fail
                return [], self._fail([s for s, _ in pieces], exc, "the prefill")
            self.prefill_steps = (self.prefill_steps + [sum(len(p) for _, p in pieces)])[-64:]
            for (s, piece), row in zip(pieces, rows):
                s.slot.history.extend(piece)
                s.prefilled += len(piece)
                if s.prefilled < len(s.ids):
                    continue
                try:
                    s.pending = s.sampler.sample(row)
                except Exception as exc:  # noqa: BLE001 - its own sampler
                    failed += self._fail([s], exc, "the sampler")
                    continue
                ready.append(s)
        tok = self.session.tokenizer
        for s in ready:
            clock = StatsClock(backend="torch", policy=str(self.session.plan.policy), prompt_tokens=len(s.ids),
                               cached_tokens=s.reused)
            s.events = stream(self._tokens(s), token_bytes=tok.token_bytes, eos=tok.eos_ids, params=s.params,
                              clock=clock, probe=self._probe(s.slot.seq_id), cancel=s.cancel,
                              started=s.prefill_started)
        return ready, failed

    # -- decoding --------------------------------------------------------------------------
    def step(self) -> list[tuple[LiveStream, GenerationEvent | StreamFailed]]:
        if not self.live:
            return []
        joining = [s for s in self.live if s.events is None]
        decoding = [s for s in self.live if s.events is not None]
        self.widest = max(self.widest, len(decoding))
        out: list = []
        with self._lock:
            ready, failed = self._prefill(joining) if joining else ([], [])
            out += failed
            if decoding:
                try:
                    logits = self.engine.decode([s.slot.seq_id for s in decoding], [s.pending for s in decoding])
                except Exception as exc:  # noqa: BLE001 - one forward for all of them: each of them fails
                    out += self._fail(decoding, exc, "the decode step")
                    decoding = []
            for s, row in zip(decoding, logits if decoding else []):
                s.slot.history.append(s.pending)
                try:
                    s.pending = s.sampler.sample(row)
                except Exception as exc:  # noqa: BLE001 - its own sampler: it fails alone
                    out += self._fail([s], exc, "the sampler")
        alive = [s for s in ready + decoding if s in self.live]
        return out + self._next_events(alive)  # the new streams' first events, the others' next ones
