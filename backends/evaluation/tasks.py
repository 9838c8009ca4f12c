"""The quality tasks of ``localctx eval``, shared by every backend's evaluator (docs/quality.md):

- perplexity of a long text processed *through* the policy's cache, chunk by chunk, the way
  decoding sees it; each chunk's next-token log-probs are scored against the cache as it stands;
- passkey retrieval over a grid of context lengths × depths, greedy, scored by exact match;
- the RULER-style long-context tasks of backends/evaluation/long_tasks.py (``--tasks``).

The text, the prompts and the token ids come from here, so a backend's rows differ from another's
only by what the cache does (both tokenizers give llama.cpp's ids for a GGUF)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from localctx.kvcache.policy import KVPolicy

if TYPE_CHECKING:
    from localctx.backends.evaluation.long_tasks import TaskResults

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
QUESTION = "\nWhat is the pass key? The pass key is"


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def long_text() -> str:
    """About 465K characters of English shipped with Python (no download)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@dataclass(frozen=True)
class PerplexityTask:
    n_tokens: int = 8192  # tokens streamed through the cache
    chunk: int = 128  # tokens per forward (a decode step sees the cache as it stands)
    score_from: int = 0  # score predictions of tokens [score_from, n_tokens)
    segment: int = 0  # also report perplexity per segment of this many tokens (0 = off)
    stride: int = 1  # score every stride-th prediction from score_from on (the others are only streamed)

    def scores(self, position: int) -> bool:
        """Whether the prediction of token ``position`` is scored."""
        first = max(1, self.score_from)
        return position >= first and (position - first) % self.stride == 0


@dataclass(frozen=True)
class NeedleTask:
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    answer_tokens: int = 6
    seed: int = 0
    chunk: int = 128  # prefill chunk: the prompt streams through the cache as in perplexity


@dataclass
class PerplexityResult:
    ppl: float
    scored: int
    segments: list[tuple[int, int, float]] = field(default_factory=list)  # (from, to, ppl)
    kv_bytes: int = 0  # what the cache held at the end
    kv_tokens: int = 0
    seconds: float = 0.0


@dataclass
class NeedleResult:
    hits: int
    total: int
    grid: list[dict] = field(default_factory=list)  # {length, depth, key, answer, hit}
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.hits / self.total if self.total else 0.0


@dataclass
class PolicyReport:
    policy: str
    exact: bool
    perplexity: PerplexityResult | None = None
    needle: NeedleResult | None = None
    long_tasks: "TaskResults | None" = None  # backends/evaluation/long_tasks.py
    backend_settings: dict = field(default_factory=dict)  # e.g. llama.cpp's cache types
    divergence: object = None  # backends/evaluation/divergence.py's Divergence from the full-precision cache


def perplexity_result(nll: Sequence[float], task: PerplexityTask, kv_bytes: int, kv_tokens: int,
                      seconds: float) -> PerplexityResult:
    """``nll[i]`` = −log p(token i | tokens < i) (``nll[0]`` unused): the perplexity from
    ``task.score_from`` (at least 1) and, with ``task.segment``, per segment."""
    n = len(nll)
    lo = max(1, task.score_from)

    def ppl(a: int, b: int) -> float:
        picked = [nll[i] for i in range(a, b) if task.scores(i)]
        return math.exp(math.fsum(picked) / max(1, len(picked)))

    segments = [(a, min(n, a + task.segment), ppl(a, min(n, a + task.segment)))
                for a in range(lo, n, task.segment)] if task.segment else []
    return PerplexityResult(ppl(lo, n), len(range(lo, n, task.stride)), segments, kv_bytes, kv_tokens, seconds)


def passkey_prompt(tokenizer: Encoder, length: int, depth: float, key: str) -> list[int]:
    """A prompt of about ``length`` tokens with the key sentence at ``depth`` (0 = start)."""
    enc = tokenizer.encode
    fixed = len(enc(INTRO + f"The pass key is {key}. Remember it. {key} is the pass key. " + QUESTION))
    per_filler = len(enc(FILLER * 8)) / 8
    n_fill = max(1, round((length - fixed) / per_filler))
    before = round(n_fill * depth)
    text = (INTRO + FILLER * before + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + FILLER * (n_fill - before) + QUESTION)
    return enc(text)


def passkey_cells(tokenizer: Encoder, task: NeedleTask):
    """(length, depth, key, prompt ids) for each cell of the grid, keys drawn from ``task.seed``."""
    import random

    rng = random.Random(task.seed)
    for length in task.lengths:
        for depth in task.depths:
            key = str(rng.randint(10000, 99999))
            yield length, depth, key, passkey_prompt(tokenizer, length, depth, key)


def needle_grid(cells, answer: Callable[[list[int]], str]) -> NeedleResult:
    """Every cell of ``passkey_cells`` answered by ``answer(prompt ids)``; a hit is an answer that
    starts with the key."""
    started = time.perf_counter()
    grid, hits = [], 0
    for length, depth, key, ids in cells:
        text = answer(ids)
        hit = text.strip().startswith(key)
        hits += hit
        grid.append({"length": length, "tokens": len(ids), "depth": depth, "key": key, "answer": text, "hit": hit})
    return NeedleResult(hits, len(grid), grid, time.perf_counter() - started)


def with_baseline(policies: Sequence[KVPolicy], baseline: bool = True) -> list[KVPolicy]:
    """The full-precision cache first (unless ``baseline`` is off), then each policy once, in order."""
    out = [KVPolicy()] if baseline else []
    for p in policies:
        if p not in out:
            out.append(p)
    return out


def text_tokens(tokenizer: Encoder, n_tokens: int) -> list[int]:
    text = long_text()
    ids = tokenizer.encode(text[:n_tokens * 8])  # ~4 characters a token: plenty, and fast to encode
    if len(ids) < n_tokens:
        ids = tokenizer.encode(text)
    return ids[:n_tokens]
