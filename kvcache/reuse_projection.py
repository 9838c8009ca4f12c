"""What reuse changes in the planner's projections: time to first token when a prefix of the prompt
is already cached (in the session, or in a prompt-cache file), and what is said about prompt
lookup's effect on decode (``backends/generation/speculation.py``).

TTFT = prefill of the uncached suffix (its FLOPs: the whole prompt's minus the prefix's, so the
suffix's attention over the prefix is counted) + reading a prefix file: its KV bytes at
``FILE_READ_BYTES_S`` (memory-mapped read plus the SHA-256 check, one pass over the bytes; a file
in the page cache reads faster, one on a slow disk slower)."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.kvcache import cost
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.speed import SpeedModel

FILE_READ_BYTES_S = 1.0e9
DECODE_NOTE = ("prompt lookup (--speculate auto) is not in the decode projection: its gain depends on how much of "
               "the answer repeats the context (up to several tokens per step when it copies, none on free text); "
               "each answer's tokens per step is in its stats")


@dataclass(frozen=True)
class TTFT:
    prompt_tokens: int
    cached_tokens: int
    from_file: bool
    prefill_s: float
    load_s: float

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.load_s

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "from_file": self.from_file,
                "prefill_s": round(self.prefill_s, 4), "load_s": round(self.load_s, 4), "ttft_s": round(self.seconds, 4)}


def projected_ttft(speed: SpeedModel, spec: ModelSpec, policy: KVPolicy, prompt_tokens: int,
                   cached_tokens: int = 0, from_file: bool = False) -> TTFT | None:
    """None when the speed model has no prefill estimate."""
    cached = max(0, min(cached_tokens, prompt_tokens - 1))
    rate = speed.prefill_tok_s(spec, prompt_tokens)
    if rate is None or prompt_tokens <= 0:
        return None
    whole_s = prompt_tokens / rate  # the estimate is FLOPs / FLOP/s: scale it by the suffix's share of FLOPs
    share = 1.0 - cost.prefill_flops(spec, cached) / cost.prefill_flops(spec, prompt_tokens)
    load_s = cost.kv_bytes(spec, policy, cached) / FILE_READ_BYTES_S if from_file else 0.0
    return TTFT(prompt_tokens, cached, from_file, whole_s * share, load_s)
