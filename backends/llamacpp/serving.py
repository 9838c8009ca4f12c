"""Continuous batching for a server on llama.cpp: conversation slots in one multi-sequence context.

The context is opened beside the session's own on the same weights (batch.BatchDecoder)
with one KV stream per slot (``kv_unified`` off); the plan's context is split between the slots,
as llama.cpp's own server does, so all slots together hold at most the plan's KV. They start with
what the plan allocates (``Plan.allocated``: serve's ``--parallel`` × 1,024 tokens) and grow, every
slot's stream together, when a request's prompt and answer do not fit its slot (``_grow``,
kvcache/growth.py): the cells move into a larger context between steps. ``open_slots`` loads
the session with a minimal context of its own (``OWN_CONTEXT`` cells: the tokenizer and weights
are what the slots share with it), so the server holds the plan's KV once, not twice. Each live stream feeds
its last token in one shared ``llama_decode`` per step (the weights are read once per step), and
streams join and leave between steps. A new stream's prompt is prefilled a chunk (``n_batch``
tokens) per step, in a ``llama_decode`` of its own after the others' decode: a long prompt delays
the streams decoding beside it by one chunk a step, and a prefill that fails fails only the
streams it prefilled. A slot keeps its cells after its request: a follow-up
that extends the conversation removes only the cells past the common prefix
(``llama_memory_seq_rm``) and prefills the rest; with ``cache_reuse`` (``--cache-reuse N``) a
follow-up that drops a middle message also keeps the cached runs after it, moved into place
(backends/llamacpp/cache_reuse.py; lossy). Windowed policies (context shift) are not
batched here; they are served one stream at a time. Slots given a ``plan`` of their own (serve's
per-request KV policies, app/serve/lanes.py) open their context with that plan's K and V types."""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from localctx.backends.base import (GenerationEvent, GenerationParams, Prompt, StatsClock, check_prompt_fits,
                                    with_template_stops)
from localctx.backends.llamacpp import shift
from localctx.backends.llamacpp.allocation import held_bytes, swa_cells_held, swa_window
from localctx.backends.llamacpp.batch import CONTEXT_PAD, BatchDecoder, DecodeSequence, KVTypes, sampler_chain
from localctx.backends.llamacpp.cache_reuse import move_runs, plan_moves
from localctx.backends.llamacpp.session import REPLAY
from localctx.backends.generation.slots import Slot, SlotStreams, choose_slot, common_prefix
from localctx.backends.generation.stream_source import StreamFailed
from localctx.backends.generation.decode_loop import KVProbe, stream
from localctx.kvcache import growth
from localctx.kvcache.errors import UserError


@dataclass
class LiveStream:
    slot: Slot
    seq: DecodeSequence  # seq.n_past: the prompt tokens in its cells so far, then every token
    params: GenerationParams
    clock: StatsClock
    cancel: threading.Event | None = None
    events: Iterator[GenerationEvent] | None = None  # None until its prompt is prefilled
    prefill_started: float | None = None  # perf_counter when its first prefill chunk ran

    @property
    def prefilling(self) -> bool:
        return self.events is None


OWN_CONTEXT = CONTEXT_PAD  # cells of the session's own context beside the slots' (llama.cpp's minimum pad)


def open_slots(ref, plan, n_slots: int, cache_reuse: int = 0) -> "LlamaSlots":
    """The session and its slots for a server: the slots' context holds the plan's KV."""
    from localctx.backends.llamacpp.session import LlamaCppSession

    session = LlamaCppSession(ref, plan, own_context=OWN_CONTEXT)
    reason = session.enable_cache_reuse(cache_reuse) if cache_reuse else None
    if reason:
        session.close()
        raise UserError(f"--cache-reuse does not apply: {reason}; drop --cache-reuse")
    return LlamaSlots(session, n_slots, cache_reuse)


class LlamaSlots(SlotStreams):
    live: list[LiveStream]

    def __init__(self, session, n_slots: int, cache_reuse: int = 0, plan=None):
        """``cache_reuse``: move cached runs of at least this many tokens into place (0: off).
        ``plan``: the slots' KV policy and context when not the session's (serve's per-request
        lanes, app/serve/lanes.py): a context of its own on the same weights, with its K and V types."""
        self.cache_reuse = cache_reuse
        self.plan = plan or session.plan
        self.settings = shift.settings_for(self.plan, shift.local_calibration(), bool(session.reuse_exact))
        most = self.plan.context // n_slots // CONTEXT_PAD * CONTEXT_PAD
        if most < CONTEXT_PAD:
            raise UserError(f"--context {self.plan.context:,} split over --parallel {n_slots} leaves less than "
                            f"{CONTEXT_PAD} tokens a slot; give a larger --context or a smaller --parallel")
        self.most_per_slot = most  # what each slot may grow to: its share of the plan's context
        first = -(-self.plan.allocated_context // n_slots // CONTEXT_PAD) * CONTEXT_PAD
        self.per_slot = min(most, max(CONTEXT_PAD, first))  # what each slot holds now (``_grow``)
        self.growths = 0  # times the slots' context grew toward the plan's
        super().__init__(session, [Slot(i) for i in range(n_slots)])
        self.decoder = BatchDecoder(session.llm, self.per_slot * n_slots, n_slots, n_batch=session.llm.n_batch,
                                    kv=KVTypes(*self.settings.type_ids(), self.settings.flash_attn))
        if self.plan.allocated is not None:  # what the slots allocated, in their cells (the whole plan: all of it)
            self._record()
        self.decoder.prefilled = True  # prompts are prefilled here, a chunk per step as they arrive
        self.llama_cpp = self.decoder.llama_cpp
        self._n_swa = None if self.decoder.params.swa_full else swa_window(session.spec)  # compact SWA cache
        self.prefill_chunk = self.decoder.n_batch
        self.prefill_steps: list[int] = []  # prompt tokens prefilled in each step that prefilled (the last 64)

    # -- growing ----------------------------------------------------------------------
    def _record(self) -> None:
        n = self.per_slot * len(self.slots)
        if self.per_slot >= self.most_per_slot:
            self.plan.grow_to(self.plan.context, self.plan.kv_bytes)
        else:
            self.plan.grow_to(n, dataclasses.replace(self.settings, n_ctx=n).cache().bytes(self.session.spec))

    def _grow(self, needed: int) -> None:
        """Every slot's stream grows to hold ``needed`` tokens (kvcache/growth.py: at least doubling, at most
        its share of the plan's context): the slots' cells move into a larger context on the same weights
        (batch.BatchDecoder.resize, the way a chat's context grows: grow.py), so live streams decode on
        and idle slots keep their conversations; the plan then says what is allocated."""
        n = growth.next_size(self.per_slot, needed, self.most_per_slot, CONTEXT_PAD)
        self.decoder.resize(n * len(self.slots), [s.seq_id for s in self.slots])
        self.per_slot = n
        self.growths += 1
        self._record()

    def _reusable(self, slot: Slot, ids: list[int]) -> tuple[int, list]:
        """(common prefix, runs that chunk reuse would move) of ``slot`` for ``ids``."""
        shared = common_prefix(slot.history, ids)
        return shared, plan_moves(slot.history, ids, shared, self.cache_reuse) if self.cache_reuse else []

    def _choose(self, ids: list[int]) -> tuple[Slot, int, list] | None:
        """choose_slot's choice, except that with chunk reuse an idle slot whose cache this prompt
        reuses for at least half of it (prefix and moved runs together) is taken first."""
        if self.cache_reuse:
            scored = [(s, *self._reusable(s, ids)) for s in self.slots if not s.busy and s.history]
            best = max(scored, key=lambda c: c[1] + sum(m.n for m in c[2]), default=None)
            if best is not None and 2 * (best[1] + sum(m.n for m in best[2])) >= len(best[0].history):
                return best
        choice = choose_slot(self.slots, ids)
        return None if choice is None else (*choice, [])

    def _window_held(self, slot: Slot, reused: int) -> bool:
        """Whether the slot still holds the cells a prompt continuing after its first ``reused`` tokens
        attends to (``swa_cells_held``, the rule a session's ``_cached_prefix`` applies too); a prompt that
        departs from the slot's conversation further back (another conversation sharing only a system
        prompt) would attend to cells that are gone, so it is prefilled from the start."""
        if self._n_swa is None:
            return True
        pos_min = self.llama_cpp.llama_memory_seq_pos_min(self.decoder.memory, slot.seq_id)
        return swa_cells_held(pos_min, reused, self._n_swa)

    def _forget(self, slot: Slot, keep: int = 0) -> None:
        self.llama_cpp.llama_memory_seq_rm(self.decoder.memory, slot.seq_id, keep, -1)
        del slot.history[keep:]

    def start(self, prompt: Prompt, params: GenerationParams, cancel: threading.Event | None,
              ids: list[int] | None = None) -> tuple[LiveStream, None] | None:
        s = self.session
        ids = s.tokenize(prompt) if ids is None else ids
        params = with_template_stops(prompt, params, s.template.stops)  # as Session.generate does
        most = self.most_per_slot
        try:
            slot_plan = dataclasses.replace(self.plan, context=most)
            check_prompt_fits(len(ids), slot_plan, s.spec, params.max_tokens)
        except UserError as exc:
            raise UserError(f"{exc} (each of the server's {len(self.slots)} slots holds {most:,} tokens; "
                            "a server with a smaller --parallel gives each more)") from None
        if params.max_tokens > most - len(ids):
            params = dataclasses.replace(params, max_tokens=most - len(ids))
        choice = self._choose(ids)
        if choice is None:
            return None
        if growth.must_grow(self.per_slot, len(ids) + params.max_tokens, most):
            self._grow(len(ids) + params.max_tokens)  # between steps, on the scheduler's thread
        sampler = sampler_chain(params, s.llm.model)  # before the slot is taken: one that fails holds nothing
        slot, shared, moves = choice
        try:
            if moves:  # cells of the old conversation past the last moved run: _forget drops them below
                move_runs(self.llama_cpp, self.decoder.memory, slot.seq_id, moves)
                shared = moves[-1].dst + moves[-1].n
                slot.history[:] = ids[:shared]
            # the prompt's last REPLAY tokens are prefilled again (at least one, for the logits): a one-row
            # batch takes other kernels than the cold run's last rows (session.REPLAY); moved runs are lossy
            reused = max(0, min(shared, len(ids) - (1 if moves else REPLAY)))
            if reused and not self._window_held(slot, reused):
                reused = 0
            self._forget(slot, reused)
        except BaseException:
            self.llama_cpp.llama_sampler_free(sampler)
            self._forget(slot)
            raise
        slot.busy = True
        seq = DecodeSequence(index=slot.seq_id, seq_id=slot.seq_id, prompt=ids, sampler=sampler, n_past=reused)
        clock = StatsClock(backend="llamacpp", policy=str(self.plan.policy), prompt_tokens=len(ids),
                           cached_tokens=reused, shifted_tokens=sum(m.n for m in moves))
        live = LiveStream(slot, seq, params, clock, cancel)
        self.live.append(live)
        return live, None  # prefilled by the next steps, a chunk at a time

    def _begin_events(self, live: LiveStream) -> None:
        s, seq = self.session, live.seq

        def kv() -> tuple[int, int, int]:
            return held_bytes(s.spec, self.settings.type_k, self.settings.type_v, seq.n_past), seq.n_past, 0

        live.events = stream(self._tokens(live), token_bytes=lambda t: s.llm.detokenize([t], special=False),
                             eos=s.eog, params=live.params, clock=live.clock, probe=KVProbe(kv), cancel=live.cancel,
                             started=live.prefill_started)

    def _tokens(self, live: LiveStream) -> Iterator[int]:
        seq = live.seq
        while seq.pending:
            yield seq.pending.popleft()  # ``step`` decodes it and samples the next one before asking again

    def _prefill(self, joining: list[LiveStream]) -> tuple[list[LiveStream], list]:
        """At most one chunk of the joining streams' prompts, oldest first, in one ``llama_decode``
        (logits at each prompt's last token: its first token is sampled). Returns (streams ready
        for their first event, StreamFailed events of those whose prefill failed)."""
        ready = [s for s in joining if s.cancel is not None and s.cancel.is_set()]
        entries: list = []
        touched: list[tuple[LiveStream, int]] = []
        budget = self.prefill_chunk
        for s in joining:
            if s in ready or budget == 0:
                continue
            seq, last = s.seq, len(s.seq.prompt) - 1
            take = min(budget, len(seq.prompt) - seq.n_past)
            entries += [(seq, seq.prompt[pos], pos, pos == last) for pos in range(seq.n_past, seq.n_past + take)]
            touched.append((s, take))
            budget -= take
        if not entries:
            return ready, []
        now = time.perf_counter()
        for s, _ in touched:
            s.prefill_started = s.prefill_started or now
        try:
            self.decoder.decode(entries)
        except Exception as exc:  # noqa: BLE001 - these prompts' decode: only their streams fail
            return ready, self._fail([s for s, _ in touched], exc, "the prefill")
        self.prefill_steps = (self.prefill_steps + [len(entries)])[-64:]
        failed: list = []
        for s, take in touched:
            seq = s.seq
            s.slot.history.extend(seq.prompt[seq.n_past:seq.n_past + take])
            seq.n_past += take
            if seq.n_past < len(seq.prompt):
                continue
            if seq.error is not None:
                failed += self._fail([s], RuntimeError(seq.error), "the sampler")
            else:
                ready.append(s)
        return ready, failed

    def step(self) -> list[tuple[LiveStream, GenerationEvent | StreamFailed]]:
        decoding = [s for s in self.live if not s.prefilling and s.seq.to_feed is not None]
        joining = [s for s in self.live if s.prefilling]
        out: list = []
        if decoding:
            self.widest = max(self.widest, len(decoding))
            entries = []
            for s in decoding:
                entries.append((s.seq, s.seq.to_feed, s.seq.n_past, True))
                s.slot.history.append(s.seq.to_feed)
                s.seq.n_past += 1
                s.seq.to_feed = None
            try:
                self.decoder.decode(entries)
            except Exception as exc:  # noqa: BLE001 - one decode for all of them: each of them fails
                out += self._fail(decoding, exc, "the decode step")
                decoding = []
            for s in [s for s in decoding if s.seq.error is not None]:
                out += self._fail([s], RuntimeError(s.seq.error), "the sampler")
                decoding.remove(s)
        ready, failed = self._prefill(joining) if joining else ([], [])
        out += failed
        for s in ready:
            self._begin_events(s)
        return out + self._next_events(ready + decoding)

    def _free(self, live: LiveStream) -> None:
        seq = live.seq
        seq.to_feed = None
        seq.pending.clear()
        if seq.sampler is not None:
            self.llama_cpp.llama_sampler_free(seq.sampler)
            seq.sampler = None

    def _in_step(self, live: LiveStream) -> bool:
        return live.seq.n_past == len(live.slot.history)

    def close(self) -> None:
        super().close()
        self.decoder.close()
