"""Structure-aware chunking under a token budget.

The text is cut on its structure — sections (markdown/setext/reStructuredText headings), then
paragraphs, then sentences, then lines, then words, and only as a last resort between
characters — and adjacent pieces are packed greedily into chunks of at most ``budget`` tokens.
Chunks are contiguous slices: joined in order they give back the text, character for character,
so nothing is dropped and nothing is counted twice. Every chunk is measured with the session's
own tokenizer (``count``) before it is accepted."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

Count = Callable[[str], int]

_HEADING = re.compile(
    r"^(?:#{1,6}[ \t]+\S.*|\S.*\n(?:={3,}|-{3,}|~{3,}|\^{3,}|\*{3,}|\+{3,}|#{3,})[ \t]*)$", re.MULTILINE)
_PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_END = re.compile(r"[.!?…][\"')\]]*\s+")
_LINE_END = re.compile(r"\n")
_WORD_END = re.compile(r"\s+")


@dataclass(frozen=True)
class Chunk:
    start: int  # character offsets into the document text: text[start:end]
    end: int
    tokens: int


def _cuts_before(pattern: re.Pattern, text: str, start: int, end: int) -> list[int]:
    return [m.start() for m in pattern.finditer(text, start, end) if start < m.start() < end]


def _cuts_after(pattern: re.Pattern, text: str, start: int, end: int) -> list[int]:
    return [m.end() for m in pattern.finditer(text, start, end) if start < m.end() < end]


def _sections(text, s, e):
    return _cuts_before(_HEADING, text, s, e)


def _paragraphs(text, s, e):
    return _cuts_after(_PARAGRAPH_END, text, s, e)


def _sentences(text, s, e):
    return _cuts_after(_SENTENCE_END, text, s, e)


def _lines(text, s, e):
    return _cuts_after(_LINE_END, text, s, e)


def _words(text, s, e):
    return _cuts_after(_WORD_END, text, s, e)


SPLITTERS = (_sections, _paragraphs, _sentences, _lines, _words)


def _spans(cuts: list[int], start: int, end: int) -> list[tuple[int, int]]:
    bounds = [start] + sorted(set(cuts)) + [end]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def chunk_text(text: str, budget: int, count: Count) -> list[Chunk]:
    """Cut ``text`` into chunks of at most ``budget`` tokens (as ``count`` measures them)."""
    if budget < 1:
        raise ValueError(f"chunk budget must be at least 1 token, got {budget}")
    if not text:
        return []
    return _pack_range(text, 0, len(text), 0, budget, count)


def pack_spans(text: str, spans: list[tuple[int, int]], budget: int, count: Count) -> list[Chunk]:
    """Pack given adjacent spans (e.g. one per partial summary) into chunks; a span over the
    budget on its own is cut on its structure."""
    return _pack_pieces(text, spans, 0, budget, count, budget)


def _pack_range(text: str, start: int, end: int, level: int, budget: int, count: Count) -> list[Chunk]:
    n = count(text[start:end])
    if n <= budget:
        return [Chunk(start, end, n)]
    while level < len(SPLITTERS):
        pieces = _spans(SPLITTERS[level](text, start, end), start, end)
        if len(pieces) > 1:
            return _pack_pieces(text, pieces, level, budget, count, budget)
        level += 1
    return _hard_split(text, start, end, budget, count)


def _pack_pieces(text: str, pieces: list[tuple[int, int]], level: int, budget: int, count: Count,
                 target: int) -> list[Chunk]:
    counts = [count(text[s:e]) for s, e in pieces]
    groups: list[list[int]] = []
    acc = 0
    for i, c in enumerate(counts):
        if groups and c <= target and acc + c <= target:
            groups[-1].append(i)
            acc += c
        else:
            groups.append([i])
            acc = c if c <= target else target + 1  # an oversized piece stays alone
    out: list[Chunk] = []
    for group in groups:
        s, e = pieces[group[0]][0], pieces[group[-1]][1]
        if len(group) == 1:
            # one piece: measured alone it may still be over; cut it one level finer
            out += _pack_range(text, s, e, level + 1, budget, count)
            continue
        n = count(text[s:e])
        if n <= budget:
            out.append(Chunk(s, e, n))
        else:
            # token counts are not additive at the seams: repack this group under a tighter target
            summed = sum(counts[i] for i in group)
            tighter = max(1, min(target, summed) - (n - budget) - 1)
            out += _pack_pieces(text, [pieces[i] for i in group], level, budget, count, tighter)
    return out


def _hard_split(text: str, start: int, end: int, budget: int, count: Count) -> list[Chunk]:
    """No structure left (one enormous 'word'): the longest prefixes that fit, by binary search."""
    out = []
    while start < end:
        lo, hi = start + 1, end
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(text[start:mid]) <= budget:
                lo = mid
            else:
                hi = mid - 1
        out.append(Chunk(start, lo, count(text[start:lo])))
        start = lo
    return out
