"""The engine: one model and one paged KV cache, and the forwards generation needs — chunked
prefill of one sequence, prefill of several short prompts in one padded forward, and one decode
step for a batch of sequences (the weights are read once per step for the whole batch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from localctx.backends.torch.llama import LlamaModel
from localctx.kvcache.block_pool import PoolExhausted
from localctx.kvcache.paged import PagedKVCache

DEFAULT_PREFILL_CHUNK = 512
PAD_WASTE = 1.25  # prompts prefilled together pad to the longest: at most this × their own tokens
TOGETHER_CHUNKS = 4  # and hold at most this many chunks' tokens, pad included (bounds the activations)


@dataclass(frozen=True)
class EngineOptions:
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK


class Engine:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, options: EngineOptions = EngineOptions()):
        self.model = model
        self.cache = cache
        self.options = options
        self.device = model.device

    def _forward(self, seq_ids: Sequence[int], tokens: torch.Tensor, all_logits: bool = False,
                 last: torch.Tensor | None = None) -> torch.Tensor:
        """One forward over the cache (``last``: each row's position whose logits are returned);
        when it raises (an allocation failure, an interrupt) in any layer, the cache is rolled back
        to its state before the step, every layer alike."""
        self.cache.begin_step(seq_ids, tokens.shape[1])
        try:
            logits = self.model.forward(tokens, self.cache, all_logits=all_logits, last=last)
        except BaseException:
            self.cache.abort_step()
            raise
        self.cache.end_step()
        return logits

    def prefill(self, seq_id: int, token_ids: Sequence[int], all_logits: bool = False) -> torch.Tensor:
        """Append ``token_ids`` to the sequence in chunks; returns the logits after the last one
        ([vocab]), or every position's ([T, vocab]) with ``all_logits``."""
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        chunk = self.options.prefill_chunk
        outs = []
        for start in range(0, ids.numel(), chunk):
            logits = self._forward([seq_id], ids[None, start:start + chunk], all_logits)
            outs.append(logits[0])
        return torch.cat(outs, dim=0) if all_logits else outs[-1]

    def prefill_together(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Prefill several sequences; returns each one's logits after its last token ([vocab]).

        Prompts of similar length (each within one chunk) go through one forward, padded after
        their tokens to the longest: a padded row's queries never see its pad keys (they come
        later), its logits are read at its own last token, and the pad K/V is cut off after the
        step. One forward multiplies each weight with every prompt's rows at once, instead of
        reading it again per prompt. Only the full-precision paged cache is padded (a policy
        cache may quantize or evict at the pad positions), and only sequences without reserved
        blocks (the pad's blocks would go back to the free list, not to the reservation); a
        policy cache, a lone prompt, and a step the pool cannot widen prefill one at a time."""
        out: dict[int, torch.Tensor] = {}
        for group in self._length_groups(token_lists):
            padded = None
            if len(group) > 1 and self._pads([seq_ids[i] for i in group]):
                try:
                    padded = self._prefill_padded([seq_ids[i] for i in group], [token_lists[i] for i in group])
                except PoolExhausted:  # the pad does not fit beside the others' blocks: one at a time
                    padded = None
            for k, i in enumerate(group):
                out[i] = padded[k] if padded is not None else self.prefill(seq_ids[i], token_lists[i])
        return [out[i] for i in range(len(token_lists))]

    def _pads(self, seq_ids: Sequence[int]) -> bool:
        cache = self.cache
        return isinstance(cache, PagedKVCache) and not any(cache.pool.reserved_for(s) for s in seq_ids)

    def _length_groups(self, token_lists: Sequence[Sequence[int]]) -> list[list[int]]:
        """Indices grouped longest first, each group padding to at most PAD_WASTE × its tokens and
        TOGETHER_CHUNKS chunks in all; a prompt longer than one chunk stays alone (chunked prefill)."""
        order = sorted(range(len(token_lists)), key=lambda i: -len(token_lists[i]))
        groups: list[list[int]] = []
        for i in order:
            n = len(token_lists[i])
            if not n:
                raise ValueError("prefill needs at least one token")
            g = groups[-1] if groups else []
            width = len(token_lists[g[0]]) if g else 0
            if g and width <= self.options.prefill_chunk and \
                    width * (len(g) + 1) <= min(PAD_WASTE * (sum(len(token_lists[j]) for j in g) + n),
                                                TOGETHER_CHUNKS * self.options.prefill_chunk):
                g.append(i)
            else:
                groups.append([i])
        return groups

    def _prefill_padded(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        lengths = [len(t) for t in token_lists]
        width = max(lengths)
        rows = [list(t) + [t[-1]] * (width - len(t)) for t in token_lists]  # any token id pads
        tokens = torch.tensor(rows, dtype=torch.long, device=self.device)
        last = torch.tensor([n - 1 for n in lengths], dtype=torch.long, device=self.device)
        starts = [self.cache.length(s) for s in seq_ids]
        logits = self._forward(seq_ids, tokens, last=last)  # PoolExhausted before anything changes when it cannot
        for seq_id, start, n in zip(seq_ids, starts, lengths):
            self.cache.truncate(seq_id, start + n)  # the pad's K/V lies past the sequence's end now
        return logits

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """One token for each sequence → [B, vocab] logits."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)[:, None]
        return self._forward(seq_ids, ids)
