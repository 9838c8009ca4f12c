"""Prompts of a given token count, cut from Python's own documentation text (no downloads).

Every series cuts its prompt from the same corpus with its own tokenizer, so all of them read the
same text; the cut falls mid-text so the continuation rarely ends early."""
from __future__ import annotations

import functools
from typing import Callable


@functools.lru_cache(maxsize=1)
def corpus() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def fit_text(count_tokens: Callable[[str], int], n_tokens: int, text: str | None = None) -> str:
    """The longest prefix of ``text`` (the corpus, repeated as needed) that takes at most ``n_tokens``.

    Binary search on characters: about 20 tokenizer calls whatever the length."""
    source = text if text is not None else corpus()
    hi = max(64, n_tokens * 6)
    while True:
        reps = hi // len(source) + 1
        pool = source * reps
        if count_tokens(pool[:hi]) > n_tokens:
            break
        hi *= 2
    lo = 1  # invariant: count(pool[:lo]) <= n_tokens < count(pool[:hi]) (one character fits any budget here)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(pool[:mid]) <= n_tokens:
            lo = mid
        else:
            hi = mid
    return pool[:lo]
