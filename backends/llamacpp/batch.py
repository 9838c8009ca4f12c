"""Several sequences decoded together in one llama.cpp context (llama-cpp-python's low-level API).

The high-level ``Llama`` object holds a single-sequence context. For a batch this module opens a
second context on the same weights with ``n_seq_max`` sequences, each in its own KV stream
(``kv_unified`` off: a token attends over its own sequence's cells only, not over every cell of
the batch; measured here, 4 × 1,700-token prompts prefill 1.6× and decode 1.5× faster than in
one unified cache), sized to what the batch needs (never more than the plan's context),
prefills every prompt in n_batch slices (logits only at each prompt's last token), then
decodes one token per live sequence per ``llama_decode`` call — the weights are read once per
step for the whole batch. Each sequence
has its own sampler chain, and its tokens go through the shared ``stream`` loop, so stop strings,
max tokens, UTF-8 and cancellation behave as in ``generate``. A finished sequence's KV cells are
released at once; the context is freed when the batch ends."""
from __future__ import annotations

import ctypes
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from localctx.backends.base import (GenerationEvent, GenerationParams, Prompt, StatsClock, check_prompt_fits,
                                    with_template_stops)
from localctx.backends.generation.decode_loop import KVProbe, stream
from localctx.backends.llamacpp.grammar import grammar_sampler
from localctx.kvcache import cost
from localctx.kvcache.errors import RuntimeFailure

MAX_SEQUENCES = 64
CONTEXT_PAD = 256  # llama.cpp's minimum padding of a context's cells: contexts here are multiples of it


@dataclass
class DecodeSequence:
    """One sequence in a BatchDecoder's context: its prompt, its sampler chain, and its tokens
    sampled but not yet streamed (``pending``) or not yet decoded into its cells (``to_feed``)."""
    index: int  # position in the caller's prompt list
    seq_id: int
    prompt: list[int]
    sampler: object
    pending: deque = field(default_factory=deque)  # sampled, not yet handed to the stream
    to_feed: int | None = None  # sampled, not yet decoded into the cache
    n_past: int = 0
    finished: bool = False
    error: str | None = None  # its sampler failed: nothing more is sampled for it


def sampler_chain(params: GenerationParams, model):
    """A llama.cpp sampler chain for ``params``: the grammar of ``params.constraint`` first where there
    is one (grammar.py; over ``model``'s vocabulary), then greedy at temperature 0, else top-k, top-p,
    temperature and a seeded draw. Its owner frees it (``llama_sampler_free``)."""
    import llama_cpp

    rules = grammar_sampler(llama_cpp.llama_model_get_vocab(model), params.constraint) if params.constraint else None
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if rules is not None:
        llama_cpp.llama_sampler_chain_add(chain, rules)  # the chain owns it now
    if params.temperature <= 0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
    seed = llama_seed(params.seed) if params.seed is not None else llama_cpp.LLAMA_DEFAULT_SEED
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed))
    return chain


def llama_seed(seed: int) -> int:
    """llama.cpp's samplers take a 32-bit seed, and 0xFFFFFFFF (LLAMA_DEFAULT_SEED) means a random
    one: any integer seed folds to 0 .. 2**32 - 2, the same seed always to the same value."""
    return seed % 0xFFFFFFFF


@dataclass(frozen=True)
class KVTypes:
    """A context's K and V ggml types and flash attention, where they differ from the session's."""
    type_k: int
    type_v: int
    flash_attn: bool


class BatchDecoder:
    """One multi-sequence llama.cpp context for one group of prompts."""

    def __init__(self, llm, n_ctx: int, n_seqs: int, n_batch: int, kv: KVTypes | None = None):
        import llama_cpp

        self.llama_cpp = llama_cpp
        params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
        if kv is not None:
            params.type_k, params.type_v = kv.type_k, kv.type_v
            params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if kv.flash_attn
                                      else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.n_ctx = n_ctx
        params.n_seq_max = n_seqs
        params.kv_unified = False  # one KV stream per sequence: n_ctx / n_seqs cells each
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, params.n_ubatch or n_batch)
        self.n_batch = n_batch
        self.model = llm.model
        self.params = params
        self.ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeFailure(f"llama.cpp could not open a {n_seqs}-sequence context of {n_ctx} tokens")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.seqs: list[DecodeSequence] = []
        self.prefilled = False
        self.captured: list | None = None  # (caller index, logits) per sampled position, when a check asks

    def _capture(self, seq: DecodeSequence, j: int) -> None:
        import numpy as np

        n_vocab = self.llama_cpp.llama_vocab_n_tokens(self.llama_cpp.llama_model_get_vocab(self.model))
        row = self.llama_cpp.llama_get_logits_ith(self.ctx, j)
        self.captured.append((seq.index, np.ctypeslib.as_array(row, shape=(n_vocab,)).copy()))

    def resize(self, n_ctx: int, seq_ids: list[int]) -> None:
        """Moves to a context of ``n_ctx`` cells (each sequence's stream: ``n_ctx / n_seq_max``) on the same
        weights, the cells of ``seq_ids`` copied into it (grow.py); a context that fails to open leaves
        this one as it was."""
        from localctx.backends.llamacpp import grow

        states = grow.read_sequences(self.ctx, seq_ids)
        params = self.llama_cpp.llama_context_params.from_buffer_copy(self.params)
        params.n_ctx = n_ctx
        ctx = self.llama_cpp.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeFailure(f"llama.cpp could not open a {params.n_seq_max}-sequence context of {n_ctx} tokens")
        self.llama_cpp.llama_free(self.ctx)
        self.ctx, self.params = ctx, params
        self.memory = self.llama_cpp.llama_get_memory(ctx)
        grow.write_sequences(ctx, states)

    def close(self) -> None:
        for seq in self.seqs:
            self._release(seq)
        if self.batch is not None:
            self.llama_cpp.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self.llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def _release(self, seq: DecodeSequence) -> None:
        if not seq.finished:
            seq.finished = True
            if self.ctx:
                self.llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
        if seq.sampler is not None:
            self.llama_cpp.llama_sampler_free(seq.sampler)
            seq.sampler = None

    # -- decoding ------------------------------------------------------------------
    def decode(self, entries: list[tuple[DecodeSequence, int, int, bool]]) -> None:
        """Decodes ``entries`` (sequence, token, position, logits wanted) in slices of ``n_batch``;
        each sequence whose logits were wanted samples its next token (``pending``, ``to_feed``)."""
        for start in range(0, len(entries), self.n_batch):
            self._decode_slice(entries[start:start + self.n_batch])

    def _decode_slice(self, entries: list[tuple[DecodeSequence, int, int, bool]]) -> None:
        b = self.batch
        for j, (seq, token, pos, want_logits) in enumerate(entries):
            b.token[j] = token
            b.pos[j] = pos
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = seq.seq_id
            b.logits[j] = 1 if want_logits else 0
        b.n_tokens = len(entries)
        code = self.llama_cpp.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeFailure(f"llama_decode failed with code {code} for a batch of {len(entries)} tokens")
        for j, (seq, _token, _pos, want_logits) in enumerate(entries):
            if want_logits and not seq.finished and seq.error is None:
                if self.captured is not None:
                    self._capture(seq, j)
                try:
                    token = self.llama_cpp.llama_sampler_sample(seq.sampler, self.ctx, j)
                except Exception as exc:  # noqa: BLE001 - this sequence's own sampler: the others go on
                    seq.error = f"{type(exc).__name__}: {exc}"
                    continue
                seq.pending.append(token)
                seq.to_feed = token

    def _prefill(self) -> None:
        self.prefilled = True
        entries: list = []
        for seq in self.seqs:
            last = len(seq.prompt) - 1
            entries += [(seq, token, pos, pos == last) for pos, token in enumerate(seq.prompt)]
            seq.n_past = len(seq.prompt)
        self.decode(entries)

    def _step(self) -> None:
        """One decode step: the last sampled token of every live sequence that needs a new one."""
        entries = []
        for seq in self.seqs:
            if not seq.finished and not seq.pending and seq.to_feed is not None:
                entries.append((seq, seq.to_feed, seq.n_past, True))
                seq.n_past += 1
                seq.to_feed = None
        self.decode(entries)

    def tokens(self, seq: DecodeSequence) -> Iterator[int]:
        try:
            while True:
                if not self.prefilled:
                    self._prefill()
                if not seq.pending:
                    self._step()
                if seq.error is not None:
                    raise RuntimeFailure(f"llama.cpp's sampler failed: {seq.error}")
                if not seq.pending:
                    return
                yield seq.pending.popleft()
        finally:
            self._release(seq)


def prompt_groups(lengths: list[int], max_tokens: int, n_ctx: int) -> list[list[int]]:
    """Prompts grouped in order so that each group fits one context: every sequence gets a KV
    stream as large as the group's longest prompt plus answer (``stream_cells``)."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        need = n + max_tokens
        if groups and len(groups[-1]) < MAX_SEQUENCES and \
                (len(groups[-1]) + 1) * stream_cells(max(longest, need)) <= n_ctx:
            groups[-1].append(i)
            longest = max(longest, need)
        else:
            groups.append([i])
            longest = need
    return groups


def stream_cells(need: int) -> int:
    """The cells of a KV stream that holds ``need`` tokens: ``need`` rounded up to CONTEXT_PAD."""
    return -(-need // CONTEXT_PAD) * CONTEXT_PAD


def generate_batch(session, prompts: Sequence[Prompt], params: GenerationParams,
                   cancel: threading.Event | None = None) -> Iterator[tuple[int, GenerationEvent]]:
    """``Session.generate_batch`` for a LlamaCppSession: (index, event) pairs, interleaved."""
    ids = [session.tokenize(p) for p in prompts]
    for tokens in ids:
        check_prompt_fits(len(tokens), session.plan, session.spec, params.max_tokens)
    budget = session.plan.context
    for group in prompt_groups([len(t) for t in ids], params.max_tokens, budget):
        cells = stream_cells(max(len(ids[i]) + params.max_tokens for i in group))
        n_ctx = len(group) * cells if len(group) > 1 else min(budget, cells)
        decoder = BatchDecoder(session.llm, n_ctx, len(group), n_batch=session.llm.n_batch)
        try:
            items = [(i, ids[i], with_template_stops(prompts[i], params, session.template.stops)) for i in group]
            yield from _run_group(session, decoder, items, cancel)
        finally:
            decoder.close()


def _run_group(session, decoder: BatchDecoder, items, cancel) -> Iterator[tuple[int, GenerationEvent]]:
    """``items``: (index, prompt tokens, that prompt's params) of each sequence."""
    policy = session.plan.policy
    streams = {}
    for seq_id, (index, tokens, params) in enumerate(items):
        seq = DecodeSequence(index=index, seq_id=seq_id, prompt=tokens, sampler=sampler_chain(params, decoder.model))
        decoder.seqs.append(seq)
        clock = StatsClock(backend="llamacpp", policy=str(policy), prompt_tokens=len(tokens))

        def kv(seq=seq) -> tuple[int, int, int]:
            n = 0 if seq.finished else seq.n_past
            return cost.kv_bytes(session.spec, policy, n), n, 0

        streams[index] = stream(decoder.tokens(seq), token_bytes=lambda t: session.llm.detokenize([t], special=False),
                                eos=session.eog, params=params, clock=clock, probe=KVProbe(kv), cancel=cancel)
    live = list(streams)
    while live:
        for index in list(live):
            event = next(streams[index], None)
            if event is None:
                live.remove(index)
                continue
            yield index, event
            if event.kind == "done":
                live.remove(index)
