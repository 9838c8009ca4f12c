"""Prompt-lookup speculative decoding, shared by the llama.cpp and torch sessions.

Each decode step, the drafter looks up the last n tokens of the context (n = 3, then 2, then 1;
prompt and answer so far) in earlier text and proposes the up to k tokens that followed its most
recent occurrence. The backend evaluates the pending token plus the draft in one forward, with
logits for every position; the longest prefix of the draft that the model agrees with is kept
and the rest is dropped from the KV cache (``Verifier.rollback``), so the cache holds exactly
what one-token-at-a-time decoding would hold.

Acceptance is the standard speculative-sampling rule with a point-mass draft: draft token x at
a position whose target distribution is p is accepted with probability p(x); on rejection the
token is drawn from p with x removed and renormalised. Greedy decoding (p = the argmax) therefore
keeps exactly the tokens plain decoding would produce, and sampling keeps its distribution.

Drafting adapts (``backends/generation/draft_policy.py``): each step drafts only when the tokens it
expects to be accepted, judged by the length of the suffix match and this session's outcomes so
far, outweigh the measured extra cost of a verify step over a plain one on this engine (before
this answer has timed its own, what the calibration measured on this backend and machine); free-form
text, whose matches are short and rarely continue, therefore almost always decodes plainly. An
answer's stats report its tokens per step and the ratio of its verify steps' time to its plain ones'."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy as np

from localctx.backends.base import GenerationParams, StatsClock
from localctx.backends.generation.draft_policy import MATCH_CAP, DraftPlanner
from localctx.kvcache.errors import UserError

MODES = ("auto", "off", "ngram")
MAX_DRAFT = 8
NGRAM_MAX = 3


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise UserError(f"--speculate {mode!r} is not one of {', '.join(MODES)}")
    return mode


class NgramDrafter:
    """The context's tokens and, for every n-gram (n ≤ NGRAM_MAX), where the token after its most
    recent occurrence sits; drafting is one dictionary look-up per n."""

    def __init__(self, max_n: int = NGRAM_MAX):
        self.max_n = max_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        toks, nxt = self.tokens, self._next
        for t in tokens:
            i = len(toks)
            for n in range(1, self.max_n + 1):
                if i >= n:
                    nxt[tuple(toks[i - n:i])] = i
            toks.append(t)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matching suffix (empty when none matches)."""
        return self.lookup(k)[0] if k > 0 else []

    def lookup(self, k: int) -> tuple[list[int], int]:
        """(up to ``k`` tokens that followed the most recent occurrence of the longest matching
        suffix of n ≤ max_n tokens, how many tokens that occurrence matches the context's end,
        counted back up to MATCH_CAP); ([], 0) when nothing matches."""
        toks = self.tokens
        end = len(toks)
        for n in range(min(self.max_n, end), 0, -1):
            at = self._next.get(tuple(toks[end - n:]))
            if at is not None:
                match = n
                while match < MATCH_CAP and at - 1 - match >= 0 and toks[at - 1 - match] == toks[end - 1 - match]:
                    match += 1
                return toks[at:at + max(0, k)], match
        return [], 0


class TokenPicker:
    """The target distribution p from logits (temperature, top-k, top-p as ``GenerationParams``
    say; greedy = argmax) and the acceptance rule. Logits are numpy float32 rows."""

    def __init__(self, params: GenerationParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.temperature <= 0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        x = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        x = np.exp(x - x.max())
        probs = x / x.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            sorted_p = probs[order]
            before = np.cumsum(sorted_p) - sorted_p
            sorted_p[before >= p.top_p] = 0.0  # keep the nucleus (at least one token)
            probs = np.zeros_like(probs)
            probs[order] = sorted_p
            probs /= probs.sum()
        return probs

    def sample(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        return int(self.rng.choice(logits.size, p=self.probs(logits)))

    def verify(self, logits: np.ndarray, draft: Sequence[int]) -> tuple[int, int]:
        """``logits[i]`` is the distribution after draft[:i]; returns (draft tokens accepted,
        the token that follows them)."""
        for i, x in enumerate(draft):
            if self.greedy:
                best = int(np.argmax(logits[i]))
                if best != x:
                    return i, best
                continue
            p = self.probs(logits[i])
            if self.rng.random() < p[x]:
                continue
            p[x] = 0.0
            return i, int(self.rng.choice(p.size, p=p / p.sum()))
        return len(draft), self.sample(logits[len(draft)])


class Verifier(Protocol):
    """What a backend gives the speculative loop for one sequence."""

    def room(self) -> int:
        """Tokens the next step may append and still match one-at-a-time decoding and be undone
        exactly (≥ 1 always: a single token is a plain decode step)."""

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` to the cache in one forward → float32 logits [len(tokens), vocab]."""

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens the previous ``step`` appended."""


@dataclass
class SpecCounters:
    """Written into the StatsClock as the loop runs."""
    clock: StatsClock

    def add(self, drafted: int, accepted: int) -> None:
        self.clock.decode_steps += 1
        self.clock.drafted_tokens += drafted
        self.clock.accepted_tokens += accepted


@dataclass
class StepTimes:
    """This answer's plain and verify step times: the verify-cost ratio its stats report."""
    plain_s: float = 0.0
    plain_n: int = 0
    verify_s: float = 0.0
    verify_n: int = 0

    def add(self, n_tokens: int, seconds: float) -> None:
        if n_tokens == 1:
            self.plain_s, self.plain_n = self.plain_s + seconds, self.plain_n + 1
        else:
            self.verify_s, self.verify_n = self.verify_s + seconds, self.verify_n + 1

    @property
    def ratio(self) -> float:
        """Mean verify step over mean plain step (0.0 until both ran)."""
        if not (self.plain_n and self.verify_n and self.plain_s > 0):
            return 0.0
        return (self.verify_s / self.verify_n) / (self.plain_s / self.plain_n)


def speculative_tokens(verifier: Verifier, context: Sequence[int], first_logits: np.ndarray,
                       params: GenerationParams, clock: StatsClock,
                       max_draft: int = MAX_DRAFT, verify_cost: dict[int, float] | None = None) -> Iterator[int]:
    """Yields the answer's tokens: the first from ``first_logits`` (after prefill of ``context``),
    then, per forward, the accepted draft tokens and the one the model chose after them.
    ``verify_cost``: the calibration's T-token verify cost in plain steps on this backend and
    machine (the planner's prior until this answer has timed its own steps)."""
    drafter = NgramDrafter()
    drafter.extend(context)
    planner = DraftPlanner(max_draft, verify_cost)
    times = StepTimes()
    picker = TokenPicker(params)
    counters = SpecCounters(clock)
    tok = picker.sample(first_logits)
    emitted = 0
    while True:
        yield tok
        emitted += 1
        drafter.extend([tok])
        budget = params.max_tokens - emitted - 1  # drafts past the last wanted token are wasted work
        candidates, match = drafter.lookup(min(max_draft, verifier.room() - 1, budget))
        draft = candidates[:planner.length(match, len(candidates))]
        started = time.perf_counter()
        logits = verifier.step([tok, *draft])
        seconds = time.perf_counter() - started
        planner.cost.record(1 + len(draft), seconds)
        times.add(1 + len(draft), seconds)
        clock.verify_cost_ratio = times.ratio
        accepted, tok = picker.verify(logits, draft)
        if draft:
            verifier.rollback(len(draft) - accepted)
            planner.acceptance.record(match, len(draft), accepted)
        elif candidates:  # not drafted: would the first proposal have been accepted? (no cost to learn it)
            planner.acceptance.record_shadow(match, candidates[0], tok)
        counters.add(len(draft), accepted)
        for d in draft[:accepted]:
            yield d
            emitted += 1
            drafter.extend([d])


def refusal(policy) -> str | None:
    """Why prompt lookup cannot run exactly under a KV policy (None when it can)."""
    if policy.heavy and policy.window is not None:
        return ("heavy-hitter scores add every query's attention mass, and a rejected draft's mass "
                "cannot be taken back")
    return None


# llama.cpp evaluates a batch of two or more tokens with other kernels than a one-token step, and which
# agree bit for bit depends on the KV type, flash attention, the CPU and how far into the text the step is:
# on the bundled SmolLM2 (AVX2) q8_0 / q4_0 KV gave one-token logits in verify batches of up to 9 rows at
# every position tried, while fp16 did only under 256 tokens (past them its one-token steps take other
# kernels, with flash attention or without). Its session therefore measures those rows once per model,
# KV and CPU (backends/llamacpp/speculate.exact_rows), drafts within them, and decodes plainly where there
# are none; auto stays off there, since what prompt lookup can draft depends on that probe.
NO_EXACT_ROWS = ("no llama.cpp verify batch gives its one-token steps' logits bit for bit for this model and KV "
                 "on this CPU, so a draft could change the text")
BATCH_NUMERICS = ("llama.cpp's multi-token verify matches its one-token step only up to the rows a per-model "
                  "probe finds; --speculate ngram opts in and drafts within them")


def resolve(mode: str, policy, batch_differs: bool = False, constrained: bool = False) -> str:
    """What runs for ``--speculate mode``: "ngram", "off", or "off (reason)" for auto where the
    result would not be exactly plain decoding's; ``ngram`` under a policy that cannot roll a
    draft back is a UserError. ``batch_differs``: the backend's multi-token steps round
    differently from its one-token steps (llama.cpp), so auto stays off and ngram is the opt-in.
    ``constrained``: the answer is sampled under a grammar (GenerationParams.constraint), one
    token at a time, so drafts are off."""
    check_mode(mode)
    if mode == "off":
        return "off"
    if constrained:
        return "off (the answer is sampled under a grammar)"
    why = refusal(policy)
    if why and mode == "ngram":
        raise UserError(f"--speculate ngram cannot run under KV policy {policy}: {why}; "
                        "use --speculate auto (it falls back to plain decoding) or off")
    if why:
        return f"off ({why})"
    if batch_differs and mode == "auto":
        return f"off ({BATCH_NUMERICS})"
    return "ngram"
