"""When prompt lookup drafts, and how many tokens: the expected number of accepted tokens against
the measured cost of a verify step, so that free text (where drafts are rarely accepted) almost
never pays for one.

**Acceptance.** The best predictor of whether the next drafted token is accepted is how long the
context's suffix matches the earlier text the draft is copied from. On greedy SmolLM2-135M
answers to the two prompts of ``benchmarks/reuse_bench.py`` (a short story; a passage copied with
one word changed), the first drafted token was accepted at 22% of the positions with a 1-token
match, 26% (2), 36% (3), 67% (4 to 7, few positions) in the story, and 98% of the positions with
a match of 8 tokens or more in the copy, where most positions sit. ``PRIOR`` holds these rates
(rounded down: a wrong guess on free text costs more than one on copying); each session's own
outcomes then move them, with ``PRIOR_WEIGHT`` pseudo-observations against each real one. A
drafted token accepted at match length m leaves a match of m + 1 for the next one, so a draft's
expected accepted tokens are E(k) = sum over j < k of the product of p(m), p(m + 1), ... p(m + j).

**Cost.** Every step is timed. Plain (one-token) steps give the base time; a verify step of
T tokens gives its cost in plain steps, time / base, kept per T, and the extra cost per drafted
token, (time / base - 1) / (T - 1). All are medians of the recent steps (the machine may be
shared; one slow step moves nothing). A step's cost is not linear in T: on llama.cpp (2 threads,
idle) a 2-token step took 1.8-2.0 plain steps, a 5-token one 3.7, while the last bench's 9-token
steps averaged about 2.4. So a length already timed is judged by its own median, and a length
not yet timed by the cheaper of the per-token extra measured so far and ``EXTRA_PRIOR`` per
drafted token: each length is tried once the prior justifies it, and then its own timing decides.

``EXTRA_PRIOR``: the first full bench run (docs/benchmarks-reuse.md, 2 threads, load about 2)
implies an extra 0.19 of a plain step per drafted token on torch (fp32 weights; more rows per
weight read cost little) and 0.48 on llama.cpp (Q4_1); the prior takes about the dearer one, so
the first drafts are judged as if on llama.cpp.

**Decision.** Draft the k (≤ the cap) that maximises tokens per unit of time,
(1 + E(k)) / cost(1 + k), if that beats a plain step (1) by ``MIN_GAIN``; otherwise step plainly."""
from __future__ import annotations

import statistics
from collections import deque

MATCH_CAP = 8  # match lengths from here on share one estimate
PRIOR = {1: 0.2, 2: 0.25, 3: 0.35, 4: 0.55, 5: 0.55, 6: 0.55, 7: 0.55, 8: 0.9}
PRIOR_WEIGHT = 4.0
EXTRA_PRIOR = 0.5
MIN_GAIN = 1.05
RECENT = 15


class Acceptance:
    """The probability that a drafted token is accepted, by the length of the suffix match behind it."""

    def __init__(self):
        self.accepted = {m: p * PRIOR_WEIGHT for m, p in PRIOR.items()}
        self.tried = {m: PRIOR_WEIGHT for m in PRIOR}

    def p(self, match: int) -> float:
        m = min(max(1, match), MATCH_CAP)
        return self.accepted[m] / self.tried[m]

    def expected(self, match: int, k: int) -> list[float]:
        """E(1), ..., E(k): expected accepted tokens of a draft of each length."""
        out, run, total = [], 1.0, 0.0
        for j in range(k):
            run *= self.p(match + j)
            total += run
            out.append(total)
        return out

    def record(self, match: int, drafted: int, accepted: int) -> None:
        """The draft's tokens up to and including the first rejected one were each a trial."""
        for j in range(min(drafted, accepted + 1)):
            m = min(max(1, match + j), MATCH_CAP)
            self.tried[m] += 1
            self.accepted[m] += 1 if j < accepted else 0


class StepCost:
    """The extra cost of one drafted token in a verify step, relative to a plain step, from timings."""

    def __init__(self):
        self.plain_s: deque[float] = deque(maxlen=RECENT)
        self.extras: deque[float] = deque(maxlen=RECENT)
        self.ratios: dict[int, deque[float]] = {}  # step length T → its recent costs in plain steps

    def record(self, n_tokens: int, seconds: float) -> None:
        if n_tokens == 1:
            self.plain_s.append(seconds)
        elif self.plain_s:
            ratio = seconds / statistics.median(self.plain_s)
            self.extras.append(max(0.0, (ratio - 1.0) / (n_tokens - 1)))
            self.ratios.setdefault(n_tokens, deque(maxlen=RECENT)).append(max(1.0, ratio))

    def extra(self) -> float:
        return statistics.median(self.extras) if self.extras else EXTRA_PRIOR

    def step_ratio(self, n_tokens: int) -> float:
        """What a step of ``n_tokens`` costs in plain steps: its own median where timed, else the
        cheaper of the measured per-token extra and the prior's."""
        timed = self.ratios.get(n_tokens)
        if timed:
            return statistics.median(timed)
        return 1.0 + min(self.extra(), EXTRA_PRIOR) * (n_tokens - 1)


class DraftPlanner:
    """How many tokens to draft at a suffix match of ``match`` tokens (0: a plain step)."""

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.acceptance = Acceptance()
        self.cost = StepCost()

    def length(self, match: int, limit: int) -> int:
        if match <= 0 or limit <= 0:
            return 0
        best_k, best = 0, MIN_GAIN
        for k, e in enumerate(self.acceptance.expected(match, min(limit, self.max_draft)), start=1):
            gain = (1.0 + e) / self.cost.step_ratio(1 + k)
            if gain > best:
                best_k, best = k, gain
        return best_k
