"""The engine: one model and one paged KV cache, and the two forwards generation needs —
chunked prefill of one sequence, and one decode step for a batch of sequences (the weights are
read once per step for the whole batch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from localctx.backends.torch.model import LlamaModel
from localctx.kvcache.paged import PagedKVCache

DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class EngineOptions:
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK


class Engine:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, options: EngineOptions = EngineOptions()):
        self.model = model
        self.cache = cache
        self.options = options
        self.device = model.device

    def _forward(self, seq_ids: Sequence[int], tokens: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """One forward over the cache; when it raises (an allocation failure, an interrupt) in any
        layer, the cache is rolled back to its state before the step, every layer alike."""
        self.cache.begin_step(seq_ids, tokens.shape[1])
        try:
            logits = self.model.forward(tokens, self.cache, all_logits=all_logits)
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

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """One token for each sequence → [B, vocab] logits."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)[:, None]
        return self._forward(seq_ids, ids)
