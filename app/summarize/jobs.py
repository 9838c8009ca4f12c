"""One document's work as a small state machine that hands out generation requests as they
become ready: map-reduce (chunk summaries, then summaries of summaries, level by level, until
one is left) or refine (a running summary extended chunk by chunk)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from localctx.app.summarize.chunking import Chunk, chunk_text, pack_spans
from localctx.app.summarize.inputs import Document
from localctx.app.summarize.prompts import PromptSet
from localctx.kvcache.errors import RuntimeFailure, UserError

MARGIN = 16  # tokens kept free for seams between template and text
MIN_CHUNK = 32


@dataclass(frozen=True)
class Settings:
    mode: str = "map-reduce"  # or "refine"
    summary_tokens: int = 256  # most tokens per generated summary
    chunk_tokens: int | None = None  # cap on chunk size; None = sized from the context budget
    max_batch: int = 8  # most sequences decoded together
    batch_tokens: int | None = None  # prompt + answer tokens in flight at once; None = the session's context


@dataclass(frozen=True)
class Budget:
    context: int
    chunk: int  # document tokens per map (or refine) chunk
    reduce: int  # tokens of partial summaries per reduce call


def plan_budget(context: int, settings: Settings, overhead: Callable[[str], int]) -> Budget:
    """Chunk sizes from the session's context budget: a chunk plus its prompt plus the answer
    (plus, in refine mode, the running summary) must fit the context; by default chunks are
    short enough that four sequences share one context, so batching backends decode them
    together. ``overhead(step)`` is the prompt's token count with an empty text."""
    answer = settings.summary_tokens
    room_map = context - overhead("map") - answer - MARGIN
    room_reduce = context - overhead("reduce") - answer - MARGIN
    if settings.mode == "refine":
        room_map = min(room_map, context - overhead("refine") - 2 * answer - MARGIN)
    need = 2 * (answer + MARGIN)
    if room_reduce < need or room_map < MIN_CHUNK:
        raise UserError(f"a context of {context:,} tokens is too small for summaries of {answer} tokens "
                        f"(prompt + two partial summaries + answer must fit); raise --context or lower "
                        f"--summary-tokens")
    if settings.chunk_tokens is not None:
        if settings.chunk_tokens < MIN_CHUNK:
            raise UserError(f"--chunk-tokens {settings.chunk_tokens} is too small; give at least {MIN_CHUNK}")
        if settings.chunk_tokens > room_map:
            raise UserError(f"--chunk-tokens {settings.chunk_tokens:,} does not fit the context of {context:,} "
                            f"tokens with the prompt and a {answer}-token answer; give at most {room_map:,}")
        chunk = settings.chunk_tokens
    else:
        chunk = min(room_map, max(256, context // 4 - overhead("map") - answer - MARGIN))
    return Budget(context=context, chunk=chunk, reduce=room_reduce)


@dataclass
class Request:
    job: "Job"
    step: str  # whole | map | reduce | refine
    level: int  # 0 = document chunks, 1.. = reductions
    index: int
    messages: list
    covers: int = 0  # document tokens this request reads directly (map/refine/whole steps)
    prompt_tokens: int | None = None  # the rendered prompt's tokens, once counted


@dataclass
class Job:
    doc: Document
    chunks: list[Chunk]
    prompts: PromptSet
    count: Callable[[str], int]
    budget: Budget
    queue: list[Request] = field(default_factory=list)
    result: str | None = None
    calls: int = 0
    depth: int = 0  # levels of reduction above the chunk summaries
    truncated_answers: int = 0  # answers that hit --summary-tokens
    empty_answers: int = 0  # answers with no text (a chunk whose summary is empty adds nothing above it)
    scheduled: int = 0  # calls known so far (grows as reduction levels are planned)

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def input_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    def text(self, chunk: Chunk) -> str:
        return self.doc.text[chunk.start:chunk.end]

    def deliver(self, request: Request, text: str, finish_reason: str) -> None:
        self.calls += 1
        if finish_reason == "length":
            self.truncated_answers += 1
        if not text.strip():
            self.empty_answers += 1
        self._accept(request, text.strip())

    def _accept(self, request: Request, text: str) -> None:
        raise NotImplementedError


class MapReduceJob(Job):
    def start(self) -> "MapReduceJob":
        n = len(self.chunks)
        if n == 1:
            self.queue = [Request(self, "whole", 0, 0, self.prompts.messages(
                "whole", title=self.doc.key, text=self.text(self.chunks[0])), covers=self.chunks[0].tokens)]
        else:
            self.queue = [Request(self, "map", 0, i, self.prompts.messages(
                "map", title=self.doc.key, part=i + 1, parts=n, text=self.text(c)), covers=c.tokens)
                for i, c in enumerate(self.chunks)]
        self._level_results: list[str | None] = [None] * len(self.queue)
        self.scheduled = len(self.queue)
        return self

    def _accept(self, request: Request, text: str) -> None:
        self._level_results[request.index] = text
        if any(r is None for r in self._level_results):
            return
        results = [r for r in self._level_results if r is not None]
        if len(results) == 1:
            self.result = results[0]
            return
        self._reduce(results, request.level + 1)

    def _reduce(self, summaries: list[str], level: int) -> None:
        pieces, spans, pos = [], [], 0
        for i, s in enumerate(summaries):
            piece = f"Part {i + 1}:\n{s}\n\n"
            pieces.append(piece)
            spans.append((pos, pos + len(piece)))
            pos += len(piece)
        joined = "".join(pieces)
        groups = pack_spans(joined, spans, self.budget.reduce, self.count)
        if len(groups) >= len(summaries):
            raise RuntimeFailure(f"{self.doc.key}: partial summaries do not shrink at level {level} "
                                 f"({len(summaries)} summaries, reduce budget {self.budget.reduce} tokens)")
        self.depth = level
        self.queue = [Request(self, "reduce", level, i, self.prompts.messages(
            "reduce", title=self.doc.key, text=joined[g.start:g.end].strip()))
            for i, g in enumerate(groups)]
        self._level_results = [None] * len(groups)
        self.scheduled += len(groups)


class RefineJob(Job):
    def start(self) -> "RefineJob":
        self._summary = ""
        self.scheduled = len(self.chunks)
        self._issue(0)
        return self

    def _issue(self, i: int) -> None:
        n, chunk = len(self.chunks), self.chunks[i]
        if i == 0:
            step, fields = ("whole", {}) if n == 1 else ("map", {"part": 1, "parts": n})
        else:
            step, fields = "refine", {"summary": self._summary, "done": i, "part": i + 1, "parts": n}
        self.queue = [Request(self, step, i, i, self.prompts.messages(
            step, title=self.doc.key, text=self.text(chunk), **fields), covers=chunk.tokens)]

    def _accept(self, request: Request, text: str) -> None:
        self._summary = text
        self.depth = request.index
        if request.index + 1 == len(self.chunks):
            self.result = text
        else:
            self._issue(request.index + 1)


def make_job(doc: Document, settings: Settings, prompts: PromptSet, count_tokens: Callable, context: int) -> Job:
    """``count_tokens`` is the session's: a str is counted raw, a message list with its chat template."""
    base = count_tokens("")  # a BOS token, where the tokenizer adds one

    def count(text: str) -> int:
        return count_tokens(text) - base

    def overhead(step: str) -> int:
        return count_tokens(prompts.messages(step, title=doc.key, text="", summary="", part=999, parts=999,
                                             done=999))

    budget = plan_budget(context, settings, overhead)
    chunks = chunk_text(doc.text, budget.chunk, count)
    cls = RefineJob if settings.mode == "refine" else MapReduceJob
    return cls(doc=doc, chunks=chunks, prompts=prompts, count=count, budget=budget).start()
