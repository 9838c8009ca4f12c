"""The reuse probe (backends/llamacpp/reuse_probe.py): exact only when a prefix prefilled in a longer
batch and a rest prefilled as a second batch give the cold run's logits bit for bit; verdicts are
remembered per key, and a damaged or foreign file is never used."""
from __future__ import annotations

import numpy as np

from localctx.backends.llamacpp import reuse_probe

VOCAB = 8


class FakeContext:
    """Logits as a function of the tokens held and of the batch each row was computed in: with
    ``batch_rounding`` a row's value depends on its batch's length (as kernels that sum in another
    order for another batch size do); without it, on the tokens alone."""

    def __init__(self, batch_rounding: bool):
        self.batch_rounding = batch_rounding
        self.rows: list[float] = []  # one value per held token
        self.n = 0

    def step(self, tokens, every_row=True):
        for j, t in enumerate(tokens):
            value = float(t * 7 + self.n + j)
            if self.batch_rounding:
                value += 1e-6 * len(tokens)
            self.rows.append(value)
        self.n += len(tokens)
        logits = np.zeros((1, VOCAB))
        logits[0, int(sum(self.rows)) % VOCAB] = 1.0
        logits[0, 0] += sum(self.rows)
        return logits

    def rollback(self, n):
        self.n -= n
        del self.rows[self.n:]


def test_exact_only_when_the_second_batch_gives_the_cold_runs_logits():
    tokens = list(range(1, reuse_probe.TEXT_TOKENS + 1))
    for rounding, exact in ((False, True), (True, False)):
        probe = FakeContext(rounding)
        cold = reuse_probe.reuse_logits(probe, tokens, None)
        reused = reuse_probe.reuse_logits(probe, tokens, reuse_probe.CUTS[0])
        assert probe.n == 0 and len(cold) == reuse_probe.STEPS + 1
        assert all(np.array_equal(a, b) for a, b in zip(cold, reused)) is exact


def test_verdicts_are_remembered_by_key_and_a_damaged_or_foreign_file_is_not_used():
    assert reuse_probe.cached("k1") is None
    reuse_probe.remember("k1", True)
    reuse_probe.remember("k2", False)
    assert reuse_probe.cached("k1") is True and reuse_probe.cached("k2") is False
    reuse_probe.verdict_path("k1").write_text("{not json")
    assert reuse_probe.cached("k1") is None
    # a file holding another key's verdict (copied or renamed) is not this key's
    reuse_probe.verdict_path("k3").write_text(reuse_probe.verdict_path("k2").read_text())
    assert reuse_probe.cached("k3") is None


def test_the_key_changes_with_the_model_and_the_context_settings(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + b"a" * 100)
    b.write_bytes(b"GGUF" + b"b" * 100)
    base = reuse_probe.cache_key(a, 1, 1, False, 2)
    assert base == reuse_probe.cache_key(a, 1, 1, False, 2)
    others = {reuse_probe.cache_key(b, 1, 1, False, 2), reuse_probe.cache_key(a, 8, 1, False, 2),
              reuse_probe.cache_key(a, 1, 1, True, 2), reuse_probe.cache_key(a, 1, 1, False, 4)}
    assert base not in others and len(others) == 4


def test_verify_rows_are_remembered_apart_from_reuse_verdicts_and_only_as_a_count():
    reuse_probe.remember("k", 9, "verify-rows")
    assert reuse_probe.cached("k", "verify-rows") == 9
    assert reuse_probe.cached("k") is None  # a count is not a reuse verdict
    reuse_probe.remember("k", True)
    assert reuse_probe.cached("k") is True and reuse_probe.cached("k", "verify-rows") == 9
    # a verdict's file renamed to stand for a count is not read as one (True is not a row count)
    reuse_probe.verdict_path("j", "verify-rows").write_text(reuse_probe.verdict_path("k").read_text().replace('"k"', '"j"'))
    assert reuse_probe.cached("j", "verify-rows") is None


def test_the_key_of_a_verdict_measured_under_a_flash_attention_setting_names_it(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"m" * 100)
    keys = {reuse_probe.cache_key(model, 1, 1, False, 2, fa) for fa in (None, True, False)}
    assert len(keys) == 3


def test_verify_costs_are_remembered_as_a_mapping_and_damage_is_not_used():
    # keys of this test's own (the probes' verdicts carry over from test to test: conftest.py)
    reuse_probe.remember("costs", {"2": 2.1, "3": 2.6}, "verify-cost")
    assert reuse_probe.cached("costs", "verify-cost") == {"2": 2.1, "3": 2.6}
    assert reuse_probe.cached("costs", "verify-rows") is None and reuse_probe.cached("costs") is None
    for bad in ({"2": 0.5}, {"1": 2.0}, {"2": "fast"}, {"two": 2.0}):  # under one plain step, one row, not numbers
        reuse_probe.remember("damaged", bad, "verify-cost")
        assert reuse_probe.cached("damaged", "verify-cost") is None, bad
    reuse_probe.remember("count", 3, "verify-rows")  # a count is not a mapping of costs
    reuse_probe.verdict_path("count", "verify-cost").write_text(
        reuse_probe.verdict_path("count", "verify-rows").read_text())
    assert reuse_probe.cached("count", "verify-cost") is None


def test_a_verify_steps_cost_is_its_time_over_the_one_token_steps_at_the_same_start():
    from localctx.backends.llamacpp.speculate import ProbeTimes

    times = ProbeTimes()
    for start, plain, two, three in ((0, [0.010, 0.011, 0.030], [0.022, 0.021], [0.030]),  # a slow first step
                                     (6, [0.010, 0.010], [0.020], [0.035]),
                                     (300, [0.020, 0.020, 0.020], [0.038], [])):  # a longer context: slower
        for s in plain:
            times.add(start, 1, s)
        for s in two:
            times.add(start, 2, s)
        for s in three:
            times.add(start, 3, s)
    times.add(300, 4, 0.015)  # faster than a one-token step (a busy moment in the one-token steps): one step
    # T = 2: 0.021 / 0.011, 0.020 / 0.010, 0.038 / 0.020 → median 1.909; T = 3: 0.030 / 0.011, 0.035 / 0.010
    assert times.costs() == {2: 1.909, 3: round((0.030 / 0.011 + 3.5) / 2, 3), 4: 1.0}
