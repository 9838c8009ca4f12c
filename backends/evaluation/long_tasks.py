"""RULER-style long-context tasks for ``localctx eval --tasks`` (docs/quality.md "Long-context tasks"):
synthetic, generated here from a seed (no download), each at a target length in tokens:

- ``niah_multikey``: several "special magic number for KEY" sentences hidden in filler; the
  question names one key, the others are distractors with other numbers;
- ``niah_multivalue``: one key given several numbers at different depths; all must be recalled;
- ``vt`` (variable tracking): ``VAR A = 12345`` then ``VAR B = VAR A`` ... hops spread through the
  filler, beside a distractor chain of another value; the answer is every name in the chain;
- ``cwe`` (common-word extraction): a numbered list of words in which a few words occur many
  times and the rest a few times each; the answer is the frequent words.

Each sample is a prompt (token ids) and the strings the answer must contain. The score of a sample
is the fraction of those strings found in the greedy answer (RULER's metric, exact substring
match); a sample is a hit when it finds them all. Prompts are plain text completions, the same
ids on every backend (the passkey's contract, backends/evaluation/tasks.py)."""
from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterator

from localctx.backends.evaluation.tasks import FILLER, Encoder, long_text
from localctx.kvcache.errors import UserError

TASKS = ("niah_multikey", "niah_multivalue", "vt", "cwe")


@dataclass(frozen=True)
class TaskSuite:
    """Which tasks, at which lengths (tokens), how many samples of each; prompts stream through the
    cache ``chunk`` tokens at a time, then greedy decoding."""
    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (2048, 4096)
    samples: int = 1
    seed: int = 0
    chunk: int = 128


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # the target; ``len(ids)`` never exceeds it
    index: int
    ids: list[int]
    expected: tuple[str, ...]  # strings the answer must contain
    answer_tokens: int  # tokens generated greedily
    text: str = field(repr=False, default="")


@dataclass
class TaskResults:
    rows: list[dict] = field(default_factory=list)  # one per sample: task, length, tokens, expected, answer, score
    seconds: float = 0.0

    def summary(self) -> list[dict]:
        """Per task and length: samples, hits (all strings found) and the mean score."""
        groups: dict[tuple[str, int], list[dict]] = {}
        for r in self.rows:
            groups.setdefault((r["task"], r["length"]), []).append(r)
        return [{"task": t, "length": n, "samples": len(rs), "hits": sum(r["hit"] for r in rs),
                 "score": sum(r["score"] for r in rs) / len(rs)} for (t, n), rs in groups.items()]


def score(answer: str, expected: tuple[str, ...]) -> float:
    """The fraction of ``expected`` strings that occur in ``answer`` (exact, case-sensitive)."""
    return sum(e in answer for e in expected) / len(expected)


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Distinct lower-case English words of 4-12 letters from the shipped text, sorted (about 2,500):
    the words that the niah keys and the cwe lists are drawn from."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,12}\b", long_text()))))


def _fit(tokenizer: Encoder, length: int, build: Callable[[int], str], units: int) -> tuple[str, list[int]]:
    """The text ``build(n)`` and its ids for ``n`` = the estimate ``units``, shrunk by the measured
    excess (and 0.5% more) until the ids fit ``length``; a prompt of one unit over it is refused."""
    n = max(1, units)
    while True:
        text = build(n)
        ids = tokenizer.encode(text)
        if len(ids) <= length or n == 1:
            if len(ids) > length:
                raise UserError(f"the shortest prompt of this task is {len(ids)} tokens, over --lengths {length}; "
                                "give longer --lengths")
            return text, ids
        n = max(1, min(n - 1, int(n * length / len(ids) * 0.995)))


def _filler_units(tokenizer: Encoder, length: int, fixed: str) -> int:
    per = len(tokenizer.encode(FILLER * 16)) / 16
    return round((length - len(tokenizer.encode(fixed))) / per)


def _spread(parts: list[str], n_fill: int, rng: random.Random) -> str:
    """``parts``, in order, at random depths among ``n_fill`` filler sentences."""
    slots = sorted(rng.randint(0, n_fill) for _ in parts)
    out, at = [], 0
    for slot, part in zip(slots, parts):
        out.append(FILLER * (slot - at))
        out.append(part)
        at = slot
    out.append(FILLER * (n_fill - at))
    return "".join(out)


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = str(rng.randint(1_000_000, 9_999_999))
        if v not in taken:
            taken.add(v)
            return v


def _keys(rng: random.Random, n: int) -> list[str]:
    words = vocabulary()
    keys: list[str] = []
    while len(keys) < n:
        k = f"{rng.choice(words)}-{rng.choice(words)}"
        if k not in keys:
            keys.append(k)
    return keys


NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n")


def niah_multikey(tokenizer: Encoder, length: int, rng: random.Random, n_keys: int = 4) -> tuple[str, list[int], tuple]:
    keys, taken = _keys(rng, n_keys), set()
    values = [_number(rng, taken) for _ in keys]
    asked = rng.randrange(n_keys)
    needles = [f"One of the special magic numbers for {k} is: {v}. " for k, v in zip(keys, values)]
    rng.shuffle(needles)
    question = (f"\nWhat is the special magic number for {keys[asked]} mentioned in the provided text? "
                f"The special magic number for {keys[asked]} mentioned in the provided text is")
    state = rng.getstate()

    def build(n_fill: int) -> str:
        rng.setstate(state)
        return NIAH_INTRO + _spread(needles, n_fill, rng) + question

    text, ids = _fit(tokenizer, length, build, _filler_units(tokenizer, length, NIAH_INTRO + "".join(needles) + question))
    return text, ids, (values[asked],)


def niah_multivalue(tokenizer: Encoder, length: int, rng: random.Random, n_values: int = 4) -> tuple[str, list[int], tuple]:
    key, taken = _keys(rng, 1)[0], set()
    values = [_number(rng, taken) for _ in range(n_values)]
    needles = [f"One of the special magic numbers for {key} is: {v}. " for v in values]
    question = (f"\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
                f"The special magic numbers for {key} mentioned in the provided text are")
    state = rng.getstate()

    def build(n_fill: int) -> str:
        rng.setstate(state)
        return NIAH_INTRO + _spread(needles, n_fill, rng) + question

    text, ids = _fit(tokenizer, length, build, _filler_units(tokenizer, length, NIAH_INTRO + "".join(needles) + question))
    return text, ids, tuple(values)


def _var_names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    return names


VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def vt(tokenizer: Encoder, length: int, rng: random.Random, hops: int = 4) -> tuple[str, list[int], tuple]:
    """One chain of ``hops`` assignments from a value, and a distractor chain of as many from another."""
    names = _var_names(rng, 2 * (hops + 1))
    taken: set[str] = set()
    value, other = _number(rng, taken)[:5], _number(rng, taken)[:5]
    while other == value:
        other = _number(rng, taken)[:5]

    def chain(vars_: list[str], v: str) -> list[str]:
        return [f"VAR {vars_[0]} = {v}. "] + [f"VAR {b} = VAR {a}. " for a, b in zip(vars_, vars_[1:])]

    main, distract = chain(names[:hops + 1], value), chain(names[hops + 1:], other)
    question = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
                f"Answer: According to the chain(s) of variable assignment in the text above, "
                f"{hops + 1} variables are assigned the value {value}, they are:")
    state = rng.getstate()

    def build(n_fill: int) -> str:
        rng.setstate(state)
        # each chain in order; the two interleave at random depths
        half = n_fill // 2
        a, b = _spread(main, half, rng), _spread(distract, n_fill - half, rng)
        return VT_INTRO + (a + b if rng.random() < 0.5 else b + a) + question

    fixed = VT_INTRO + "".join(main + distract) + question
    text, ids = _fit(tokenizer, length, build, _filler_units(tokenizer, length, fixed))
    return text, ids, tuple(names[:hops + 1])


CWE_INTRO = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n"


def cwe(tokenizer: Encoder, length: int, rng: random.Random, n_common: int = 5,
        rare_freq: int = 3) -> tuple[str, list[int], tuple]:
    """``n_common`` words 30 times each (fewer below 4,096 tokens: ``length`` / 128, at least 6) among
    rare words ``rare_freq`` times each; the list grows with ``length`` by adding rare words."""
    common_freq = max(6, min(30, length // 128))
    words = list(vocabulary())
    rng.shuffle(words)
    common, rare_pool = words[:n_common], words[n_common:]
    question = (f"\nQuestion: What are the {n_common} most common words in the above list? "
                f"Answer: The top {n_common} words that appear most often in the list are:")
    state = rng.getstate()

    def build(n_rare: int) -> str:
        rng.setstate(state)
        items = common * common_freq + rare_pool[:n_rare] * rare_freq
        rng.shuffle(items)
        return CWE_INTRO + "".join(f"{i + 1}. {w}\n" for i, w in enumerate(items)) + question

    probe = build(200)
    per_word = (len(tokenizer.encode(probe)) - len(tokenizer.encode(build(100)))) / (100 * rare_freq)
    estimate = round((length - len(tokenizer.encode(build(0)))) / per_word / rare_freq)
    if estimate > len(rare_pool):
        raise UserError(f"cwe at {length} tokens needs {estimate} distinct words and the built-in vocabulary has "
                        f"{len(rare_pool)}; give shorter --lengths for cwe")
    text, ids = _fit(tokenizer, length, build, estimate)
    return text, ids, tuple(common)


GENERATORS = {"niah_multikey": (niah_multikey, 16), "niah_multivalue": (niah_multivalue, 48),
              "vt": (vt, 32), "cwe": (cwe, 40)}  # name → (generator, tokens answered)


def samples(tokenizer: Encoder, suite: TaskSuite) -> Iterator[Sample]:
    """Every (task, length, index) of the suite; each sample's generator is seeded from
    (seed, task, length, index), so a sample does not change when others are added."""
    for task in suite.tasks:
        make, answer_tokens = GENERATORS[task]
        for length in suite.lengths:
            for i in range(suite.samples):
                rng = random.Random(f"{suite.seed}:{task}:{length}:{i}")
                text, ids, expected = make(tokenizer, length, rng)
                yield Sample(task, length, i, ids, expected, answer_tokens, text)


def run(sample_list: list[Sample], answer: Callable[[list[int], int], str]) -> TaskResults:
    """Each sample answered by ``answer(prompt ids, tokens to generate)``, scored."""
    started = time.perf_counter()
    out = TaskResults()
    for s in sample_list:
        text = answer(s.ids, s.answer_tokens)
        sc = score(text, s.expected)
        out.rows.append({"task": s.task, "length": s.length, "tokens": len(s.ids), "sample": s.index,
                         "expected": list(s.expected), "answer": text, "score": sc, "hit": sc == 1.0})
    out.seconds = time.perf_counter() - started
    return out
