"""When prompt lookup drafts (backends/generation/draft_policy.py): by the suffix match's length, the
session's outcomes and the measured cost of a verify step."""
from __future__ import annotations

import itertools
import numpy as np

from localctx.backends.base import GenerationParams, StatsClock
from localctx.backends.generation.speculation import NgramDrafter, speculative_tokens
from localctx.backends.generation.draft_policy import EXTRA_PRIOR, PRIOR, TRUSTED, Acceptance, DraftPlanner, StepCost


def test_lookup_counts_how_far_back_the_match_reaches():
    d = NgramDrafter()
    d.extend([7, 1, 2, 3, 4, 9, 9, 5, 1, 2, 3, 4])
    assert d.lookup(3) == ([9, 9, 5], 4)  # "1 2 3 4" matches, "7" before it does not
    d.extend([8])
    assert d.lookup(3) == ([], 0)
    d.extend([9])
    assert d.lookup(2) == ([5, 1], 1)  # the most recent "9" was followed by 5
    assert d.lookup(-1) == ([], 1)


def test_short_matches_on_a_fresh_session_step_plainly_and_long_ones_draft():
    planner = DraftPlanner(max_draft=8)
    assert planner.length(1, 8) == 0  # a 1-token match: accepted about one time in five
    assert planner.length(2, 8) == 0
    assert planner.length(8, 8) > 0
    assert planner.length(8, 0) == 0 and planner.length(0, 8) == 0


def test_rejections_stop_drafting_and_acceptances_lengthen_drafts():
    planner = DraftPlanner(max_draft=8)
    first = planner.length(8, 8)
    for _ in range(6):
        planner.acceptance.record(8, first, 0)
    assert planner.length(8, 8) == 0
    planner = DraftPlanner(max_draft=8)
    for _ in range(20):
        planner.acceptance.record(8, 8, 8)
    assert planner.length(8, 8) > first


def test_acceptance_moves_the_prior_by_observed_trials_and_chains_match_lengths():
    acc = Acceptance()
    assert acc.p(20) == PRIOR[8] and acc.p(0) == PRIOR[1]
    acc.record(3, drafted=4, accepted=1)  # token 0 accepted at match 3, token 1 rejected at match 4
    assert acc.p(3) > PRIOR[3] and acc.p(4) < PRIOR[4]
    assert acc.p(5) == PRIOR[5]  # the tokens after the rejection were never tried
    e = acc.expected(6, 3)
    assert np.isclose(e[0], acc.p(6)) and np.isclose(e[1], acc.p(6) + acc.p(6) * acc.p(7))


def timed(planner: DraftPlanner, ratio_of) -> None:
    """Give ``planner`` a plain step of 10 ms and TRUSTED timings of every verify length."""
    planner.cost.record(1, 0.010)
    for t in range(2, 10):
        for _ in range(TRUSTED):
            planner.cost.record(t, 0.010 * ratio_of(t))


def test_measured_verify_cost_decides_the_draft_length():
    cost = StepCost()
    assert cost.extra() == EXTRA_PRIOR
    cost.record(5, 0.5)  # no plain step timed yet: nothing to compare with
    assert cost.extra() == EXTRA_PRIOR and cost.step_ratio(5) == 1 + 4 * EXTRA_PRIOR
    cost = StepCost()
    for s in (0.010, 0.011, 0.009):
        cost.record(1, s)
    for _ in range(TRUSTED):
        cost.record(5, 0.027)  # 4 extra tokens cost 2 plain steps (against the fastest plain step)
    assert np.isclose(cost.extra(), 0.5)
    assert np.isclose(cost.step_ratio(5), 3.0) and np.isclose(cost.step_ratio(3), 2.0)  # timed; untimed: 1 + 0.5 * 2
    cheap, dear = DraftPlanner(8), DraftPlanner(8)
    timed(cheap, lambda t: 1 + 0.05 * (t - 1))
    timed(dear, lambda t: 1 + 2.0 * (t - 1))
    assert cheap.length(8, 8) == 8
    assert dear.length(8, 8) == 0


def test_a_loaded_machine_does_not_make_verify_steps_look_dear():
    cost = StepCost()
    for s in (0.010, 0.031, 0.012, 0.045):  # plain steps, some caught by other work
        cost.record(1, s)
    for s in (0.080, 0.024, 0.070):  # 9-token steps: the quiet one is 2.4 plain steps
        cost.record(9, s)
    assert np.isclose(cost.step_ratio(9), 2.4)


def test_a_length_not_yet_timed_is_judged_by_the_per_token_estimate_within_its_timed_neighbours():
    planner = DraftPlanner(8)
    planner.cost.record(1, 0.010)
    for _ in range(TRUSTED):  # short verify steps were dear (llama.cpp: about half a plain step per token)
        planner.cost.record(2, 0.019)
        planner.cost.record(3, 0.028)
    assert np.isclose(planner.cost.extra(), 0.9)
    # never timed: 1 + EXTRA_PRIOR per drafted token (the measured 0.9 is capped), not as cheap as
    # the cheapest timed step (1.9), which made free text try every long draft once
    assert np.isclose(planner.cost.step_ratio(9), 1 + EXTRA_PRIOR * 8)
    assert np.isclose(planner.cost.step_ratio(4), 2.8)  # never below a shorter step's timing
    planner.cost.record(6, 0.030)  # one timing of a longer step caps the lengths below it
    assert np.isclose(planner.cost.step_ratio(5), 3.0)
    story = DraftPlanner(8)  # free text: a long match continues about half the time
    story.cost.record(1, 0.010)
    for _ in range(TRUSTED):
        story.cost.record(2, 0.017)
    for m in range(1, 9):
        for _ in range(40):
            story.acceptance.record_shadow(m, proposed=42, chosen=42 if _ % 2 else 7)
    assert story.length(8, 8) == 0  # no draft pays for itself at about half a plain step per token
    copy = DraftPlanner(8)  # a copy: accepted almost always; the long draft is tried and then timed cheap
    copy.cost.record(1, 0.010)
    for _ in range(TRUSTED):
        copy.cost.record(2, 0.017)
    for _ in range(40):
        copy.acceptance.record_shadow(8, proposed=42, chosen=42)
    assert copy.length(8, 8) == 8  # worth it even at 1 + 0.5 per drafted token
    copy.cost.record(9, 0.020)  # torch: a 9-token step costs about two plain ones
    assert np.isclose(copy.cost.step_ratio(6), 2.0)  # and the lengths below it no more
    assert copy.length(8, 8) == 8
    dear = DraftPlanner(8)
    for _ in range(40):
        dear.acceptance.record_shadow(8, proposed=42, chosen=42)
    timed(dear, lambda t: float(t))  # every drafted token costs a plain step: even a copy decodes plainly
    assert dear.length(8, 8) == 0


def test_plain_steps_teach_the_acceptance_of_the_match_lengths_that_never_draft():
    planner = DraftPlanner(8)
    assert planner.length(3, 8) == 0  # the prior: a 3-token match is accepted about one time in three
    for _ in range(20):  # a copy: the proposal after a 3-token match is what the model chose
        planner.acceptance.record_shadow(3, proposed=42, chosen=42)
        planner.acceptance.record_shadow(4, proposed=42, chosen=42)
    assert planner.acceptance.p(3) > 0.8 and planner.length(3, 8) > 0
    story = DraftPlanner(8)
    for _ in range(20):
        story.acceptance.record_shadow(8, proposed=42, chosen=7)
    assert story.acceptance.p(8) < PRIOR[8] / 2 and story.length(8, 8) == 0


class CountingVerifier:
    """A model that always continues 1 2 3 4 1 2 3 4 ...; counts the tokens each step evaluates."""

    def __init__(self):
        self.steps: list[int] = []

    def room(self) -> int:
        return 100

    def step(self, tokens):
        self.steps.append(len(tokens))
        logits = np.zeros((len(tokens), 6), dtype=np.float32)
        for i, t in enumerate(tokens):
            logits[i, t % 4 + 1] = 1.0
        return logits

    def rollback(self, n: int) -> None:
        pass


def test_the_loop_drafts_once_the_repetition_is_long_and_keeps_the_greedy_tokens():
    verifier = CountingVerifier()
    first = np.zeros(6, dtype=np.float32)
    first[1] = 1.0
    clock = StatsClock(backend="test", policy="fp16", prompt_tokens=4)
    tokens = speculative_tokens(verifier, [1, 2, 3, 4], first, GenerationParams(max_tokens=40), clock)
    out = list(itertools.islice(tokens, 40))  # the loop runs on; the caller's stream stops it
    assert out == [(i % 4) + 1 for i in range(40)]
    assert verifier.steps[0] == 1  # the match behind the first step is short: a plain step
    assert max(verifier.steps) > 1 and len(verifier.steps) < 39
    assert clock.accepted_tokens == clock.drafted_tokens


def test_the_calibrated_verify_cost_is_the_prior_before_any_step_is_timed():
    """A machine where a verify step costs nearly a plain one (the calibration says so) drafts at a
    3-token match; one where a T-token step costs T plain steps never drafts: no draft can pay."""
    default = DraftPlanner(8)
    cheap = DraftPlanner(8, verify_cost={t: 1.0 + 0.02 * (t - 1) for t in range(2, 10)})
    dear = DraftPlanner(8, verify_cost={t: float(t) for t in range(2, 10)})
    assert default.length(3, 8) == 0 and cheap.length(3, 8) > 0
    assert dear.length(8, 8) == 0 < default.length(8, 8)
    assert dear.cost.step_ratio(5) == 5.0 and np.isclose(cheap.cost.step_ratio(5), 1.08)
    # once this answer's own steps are timed, they decide: here verify steps turn out cheap
    timed(dear, lambda t: 1.0 + 0.05 * (t - 1))
    assert dear.length(8, 8) > 0


def test_an_untimed_length_without_calibration_keeps_the_default_prior():
    cost = StepCost({})
    assert cost.prior_extra(4) == EXTRA_PRIOR and cost.extra() == EXTRA_PRIOR
    assert StepCost({3: 2.0}).prior_extra(3) == 0.5 and StepCost({3: 2.0}).prior_extra(4) == EXTRA_PRIOR


def test_the_loop_reports_its_verify_cost_ratio(monkeypatch):
    """The clock carries the mean verify step over the mean plain step of this answer (time here is
    a fake clock that each step advances: plain 4 ms, a T-token step 2 + 2T ms)."""
    from localctx.backends.generation import speculation

    now = [0.0]
    monkeypatch.setattr(speculation.time, "perf_counter", lambda: now[0])

    class SlowVerifier(CountingVerifier):
        def step(self, tokens):
            now[0] += 0.002 * (1 + len(tokens))
            return super().step(tokens)

    verifier = SlowVerifier()
    first = np.zeros(6, dtype=np.float32)
    first[1] = 1.0
    clock = StatsClock(backend="test", policy="fp16", prompt_tokens=4)
    list(itertools.islice(speculative_tokens(verifier, [1, 2, 3, 4], first, GenerationParams(max_tokens=60),
                                             clock), 60))
    verify = [t for t in verifier.steps if t > 1]
    assert verify and 1 in verifier.steps
    expected = (sum(2 + 2 * t for t in verify) / len(verify)) / 4.0
    assert np.isclose(clock.verify_cost_ratio, expected)
    assert clock.stats(0, 0).to_dict()["verify_cost_ratio"] == round(expected, 3)
