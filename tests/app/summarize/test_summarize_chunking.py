"""Chunking: no chunk over the budget, every character in exactly one chunk, structure first."""
import math
import re

import pytest
from hypothesis import given, settings, strategies as st

from localctx.app.summarize.chunking import chunk_text, pack_spans


def words(text: str) -> int:
    return len(re.findall(r"\s*\S+\s*|\s+", text))


def quarter_chars(text: str) -> int:  # not additive at the seams: ceil(a) + ceil(b) != ceil(a + b)
    return math.ceil(len(text) / 4)


def check(text, chunks, budget, count):
    assert "".join(text[c.start:c.end] for c in chunks) == text
    assert all(c.start < c.end for c in chunks)
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
    for c in chunks:
        assert c.tokens == count(text[c.start:c.end])
        assert c.tokens <= budget


TEXTS = st.lists(st.sampled_from(list("ab .!?\n#=-\té") + ["word ", "\n\n", "# H\n", "Title\n=====\n"]),
                 max_size=150).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS, budget=st.integers(1, 40))
def test_chunks_cover_text_exactly_once_and_fit(text, budget):
    for count in (words, quarter_chars):
        check(text, chunk_text(text, budget, count), budget, count)


def test_long_real_text_packs_close_to_budget():
    import pydoc_data.topics as topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)[:40])
    chunks = chunk_text(text, 300, words)
    check(text, chunks, 300, words)
    total = words(text)
    assert len(chunks) <= math.ceil(total / 300) * 1.5  # packed, not one chunk per sentence


def test_sections_are_kept_whole_when_they_fit():
    sections = [f"# Section {i}\n\n" + " ".join(f"w{i}_{j}." for j in range(20)) + "\n\n" for i in range(6)]
    text = "".join(sections)
    assert words(sections[0]) == 23
    chunks = chunk_text(text, 40, words)  # one section fits, two do not
    check(text, chunks, 40, words)
    assert [text[c.start:c.end] for c in chunks] == sections


def test_paragraphs_then_sentences_when_a_section_is_too_long():
    para = " ".join(f"Sentence {i} has five words." for i in range(10))  # 50 words
    text = f"# Only\n\n{para}\n\n{para}\n"
    chunks = chunk_text(text, 30, words)
    check(text, chunks, 30, words)
    pieces = [text[c.start:c.end] for c in chunks]
    # every cut falls after a sentence end (or the heading / paragraph break), never mid-sentence
    assert all(p.rstrip().endswith((".", "Only")) for p in pieces)


def test_a_giant_word_is_cut_between_characters():
    text = "x" * 1000
    chunks = chunk_text(text, 7, quarter_chars)
    check(text, chunks, 7, quarter_chars)
    assert len(chunks) == math.ceil(1000 / 28)


def test_pack_spans_keeps_span_boundaries():
    spans_text = ["Part 1:\nalpha beta\n\n", "Part 2:\ngamma\n\n", "Part 3:\ndelta epsilon zeta\n\n"]
    text = "".join(spans_text)
    spans, pos = [], 0
    for s in spans_text:
        spans.append((pos, pos + len(s)))
        pos += len(s)
    chunks = pack_spans(text, spans, 7, words)
    check(text, chunks, 7, words)
    assert [text[c.start:c.end] for c in chunks] == [spans_text[0] + spans_text[1], spans_text[2]]


def test_budget_must_be_positive():
    with pytest.raises(ValueError):
        chunk_text("text", 0, words)
