"""The decision table of docs/planner.md: 6 machines × 4 models × 3 contexts, each decision within
memory and explained."""
import pytest

from localctx.backends.machine.planner_inputs import TABLE_CONTEXTS, TABLE_HARDWARE, TABLE_MODELS, decision_rows
from localctx.kvcache import cost
from localctx.kvcache.planner import SAFETY_MIN, default_runtime_bytes


@pytest.fixture(scope="module")
def rows():
    return decision_rows()


def test_the_grid_is_complete(rows):
    assert len(rows) == len(TABLE_HARDWARE) * len(TABLE_MODELS) * len(TABLE_CONTEXTS)


def test_no_plan_exceeds_memory(rows):
    for r in rows:
        if r.plan is None:
            continue
        p = r.plan
        assert p.kv_bytes == cost.max_kv_bytes(r.spec, p.policy, r.context)
        assert p.kv_bytes <= r.budget_kv, (r.hardware.name, r.spec.name, r.context)
        runtime = default_runtime_bytes(r.spec, r.hardware.kind)
        assert p.weight_bytes + p.kv_bytes + runtime + SAFETY_MIN <= r.hardware.free_bytes


def test_every_decision_carries_its_reasons(rows):
    for r in rows:
        if r.plan is None:
            assert r.refusal and ("does not fit" in r.refusal or r.rejected)
            assert all(x.reason for x in r.rejected)
            continue
        assert any(x.startswith(("exact", "lossy", "8-bit", "4-bit")) for x in r.plan.reasons)
        assert any("tok/s" in x for x in r.plan.reasons)
        assert all(x.reason for x in r.plan.rejected)
        if not r.plan.exact:  # something more exact was rejected, and it says why
            assert r.plan.rejected


def test_expected_landmarks(rows):
    by = {(r.profile, r.spec.name.split(" ")[0], r.context): r for r in rows}
    # 8 GB M1 cannot hold an 8B model in bf16; a 24 GB RTX 4090 holds it exactly at its trained 8K context
    assert by[("m1-8gb", "Llama-3-8B-Instruct", 4096)].plan is None
    assert by[("rtx4090", "Llama-3-8B-Instruct", 4096)].plan.exact
    # past Llama-3's trained 8K, every plan that exists keeps a window inside it
    for key, r in by.items():
        if key[1] == "Llama-3-8B-Instruct" and key[2] > 8192 and r.plan:
            assert r.plan.policy.capacity() <= 8192
    # the 70B with 4-bit weights only fits the 64 GB Mac (which formats past 4K depends on the mlx backend)
    assert {k[0] for k, r in by.items() if k[1] == "Llama-3.1-70B-Instruct" and r.plan} == {"m2-max-64gb"}
    assert by[("m2-max-64gb", "Llama-3.1-70B-Instruct", 4096)].plan.exact
