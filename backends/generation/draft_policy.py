"""When prompt lookup drafts, and how many tokens: the expected number of accepted tokens against
the measured cost of a verify step, so that free text (where drafts are rarely accepted) almost
never pays for one.

**Acceptance.** The best predictor of whether the next drafted token is accepted is how long the
context's suffix matches the earlier text the draft is copied from. On greedy SmolLM2-135M
answers to the two prompts of ``benchmarks/reuse/reuse_bench.py`` (a short story; a passage copied with
one word changed), the first drafted token was accepted at 22% of the positions with a 1-token
match, 26% (2), 36% (3), 67% (4 to 7, few positions) in the story, and 98% of the positions with
a match of 8 tokens or more in the copy, where most positions sit. ``PRIOR`` holds these rates
(rounded down: a wrong guess on free text costs more than one on copying); each session's own
outcomes then move them, with ``PRIOR_WEIGHT`` pseudo-observations against each real one. Every
step is an outcome, drafted or not: after a plain step the loop checks whether the token the
drafter would have proposed is the one the model chose (``record_shadow``), the same event as a
drafted token being accepted. Without that, a match length at which the prior says "do not
draft" would never be tried and so never learnt: on the bench's copy task the planner waited for
8-token matches before every draft (1.27 tokens per step). A drafted token accepted at match
length m leaves a match of m + 1 for the next one, so a draft's expected accepted tokens are
E(k) = sum over j < k of the product of p(m), p(m + 1), ... p(m + j).

**Cost.** Every step is timed. A step's cost in plain steps is the fastest of the recent steps
of its length over the fastest of the recent plain (one-token) steps: on a shared machine other
work only ever adds time, so the fastest recent timing is the step's own cost and a median would
count the load (a verify step, longer, is more often caught by it). The extra cost per drafted
token is (ratio - 1) / (T - 1). It differs by engine (``benchmarks/reuse/verify_cost.py``, idle, 2
threads, docs/results/reuse/benchmarks-verify-cost.json): on llama.cpp (Q4_1) a T-token step costs about
1 + 0.5 (T - 1) plain steps (1.66 at T = 2, 3.33 at 5, 4.94 at 9); on torch (fp32) a 2-token
step 1.77 and a 9-token one 2.0. So a length timed ``TRUSTED`` times is judged by its own timing;
one timed fewer times by the cheaper of that and the per-token estimate, 1 + (the extra measured
so far, at most ``EXTRA_PRIOR``) per drafted token (a single slow timing, a busy moment, does not
rule it out); one never timed by that estimate, kept between the timings of the nearest shorter
and longer lengths (a longer step never costs less). A long draft is thus tried where its
expected acceptance pays for it at ``EXTRA_PRIOR`` per token (a copy: torch then finds its long
steps cheap), and not on free text. (Counting an untimed length as cheap as the cheapest timed
one had free text try each long draft once, which cost llama.cpp more than its accepted drafts
saved: docs/benchmarks-reuse.md.)

Before a length is timed, the prior is what a verify step of that length costs with this model and KV
on this machine where the backend measured it (llama.cpp: the exact-rows probe times its steps,
backends/llamacpp/speculate.ProbeTimes, remembered with its verdict), else the calibration's own timing
of one (``localctx plan --calibrate`` on llama.cpp stores fp16's as ``verify_step_cost``:
kvcache/calibration.py), else ``EXTRA_PRIOR``. The KV type matters: without a per-KV prior an int8
SmolLM2 answer tried each length three times at fp16's cost before its own timings ruled them out, and
lost more on free text than its accepted drafts gained (docs/benchmarks-reuse.md).

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
TRUSTED = 3  # timings of a step length before its own cost alone decides


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

    def record_shadow(self, match: int, proposed: int, chosen: int) -> None:
        """A plain step at a suffix match of ``match`` tokens: the drafter would have proposed
        ``proposed`` and the model chose ``chosen`` — one trial, as if drafted."""
        self.record(match, 1, int(proposed == chosen))


class StepCost:
    """What a verify step costs in plain steps, from the fastest recent timing of each length;
    ``prior``: what the calibration measured on this backend and machine (T → cost in plain steps,
    kvcache/calibration.py's ``verify_step_cost``), else EXTRA_PRIOR per drafted token."""

    def __init__(self, prior: dict[int, float] | None = None):
        self.prior = dict(prior or {})
        self.plain_s: deque[float] = deque(maxlen=RECENT)
        self.step_s: dict[int, deque[float]] = {}  # step length T → its recent timings
        self._ratios: dict[int, float] | None = None  # ratios(), until the next timing

    def record(self, n_tokens: int, seconds: float) -> None:
        self._ratios = None
        if n_tokens == 1:
            self.plain_s.append(seconds)
        else:
            self.step_s.setdefault(n_tokens, deque(maxlen=RECENT)).append(seconds)

    def ratios(self) -> dict[int, float]:
        """Step length → its cost in plain steps (lengths timed at least once, after a plain step)."""
        if self._ratios is None:
            base = min(self.plain_s) if self.plain_s else None
            self._ratios = {} if base is None else \
                {t: max(1.0, min(times) / base) for t, times in self.step_s.items() if times}
        return self._ratios

    def prior_extra(self, n_tokens: int) -> float:
        """The prior's extra cost of a drafted token in a step of ``n_tokens``: the calibration's
        where it timed that length, else EXTRA_PRIOR."""
        cost = self.prior.get(n_tokens)
        return (cost - 1.0) / (n_tokens - 1) if cost is not None and n_tokens > 1 else EXTRA_PRIOR

    def extra(self) -> float:
        """The median extra cost of a drafted token over the lengths timed so far (before any:
        the prior's median)."""
        extras = [(r - 1.0) / (t - 1) for t, r in self.ratios().items()]
        if not extras:
            extras = [self.prior_extra(t) for t in self.prior] or [EXTRA_PRIOR]
        return statistics.median(extras)

    def step_ratio(self, n_tokens: int) -> float:
        """What a step of ``n_tokens`` costs in plain steps: its own timing once it is TRUSTED,
        else the cheaper of that and the per-token estimate (the measured extra or the prior's)."""
        ratios = self.ratios()
        estimate = 1.0 + min(self.extra(), self.prior_extra(n_tokens)) * (n_tokens - 1)
        timed = ratios.get(n_tokens)
        if timed is None:  # never timed: the estimate, between the nearest timed lengths around it
            shorter = [r for t, r in ratios.items() if t < n_tokens]
            longer = [r for t, r in ratios.items() if t > n_tokens]
            estimate = max([estimate, *shorter])
            return min([estimate, *longer])
        return timed if len(self.step_s[n_tokens]) >= TRUSTED else min(timed, estimate)


class DraftPlanner:
    """How many tokens to draft at a suffix match of ``match`` tokens (0: a plain step)."""

    def __init__(self, max_draft: int, verify_cost: dict[int, float] | None = None):
        self.max_draft = max_draft
        self.acceptance = Acceptance()
        self.cost = StepCost(verify_cost)

    def length(self, match: int, limit: int) -> int:
        if match <= 0 or limit <= 0:
            return 0
        best_k, best = 0, MIN_GAIN
        for k, e in enumerate(self.acceptance.expected(match, min(limit, self.max_draft)), start=1):
            gain = (1.0 + e) / self.cost.step_ratio(1 + k)
            if gain > best:
                best_k, best = k, gain
        return best_k
