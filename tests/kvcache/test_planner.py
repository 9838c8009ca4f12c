"""The planner's choices and reasons: preference order, memory fit, trained context, speed target."""
import pytest

from localctx.backends.machine import detect
from localctx.backends.fake.backend import FakeBackend
from localctx.backends.machine.planner_inputs import backend_view
from localctx.kvcache import cost
from localctx.kvcache.calibration import Calibration, FormatCost
from localctx.kvcache.errors import UserError
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.planner import BackendView, NoPlanFits, PlanRequest, budget, parse_size, plan
from localctx.kvcache.projection import projection_contexts, projections
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.speed import SpeedModel

EVERYTHING = BackendView("fake", FakeBackend(0).capabilities().refusals)
SMOL = known_spec("smollm2-135m")
CPU = detect.named("cpu-24gb")


def synthetic_calibration(fp16=8e-11, int8=4e-10, int4=1e-9, base=0.006) -> Calibration:
    """A calibration on the SmolLM2 weights: base seconds per step plus seconds per KV byte."""
    return Calibration(backend="fake", hardware_key=CPU.key, model=SMOL.name, weight_bytes=SMOL.weight_bytes,
                       bandwidth_bytes_s=CPU.bandwidth_bytes_s,
                       formats={"fp16": FormatCost(base, fp16), "int8": FormatCost(base, int8),
                                "int4": FormatCost(base, int4)})


def test_exact_fp16_is_preferred_when_it_fits_and_the_speed_is_stated():
    p = plan(detect.named("rtx4090"), known_spec("llama-3-8b"), PlanRequest(context=8192), EVERYTHING)
    assert str(p.policy) == "fp16" and p.exact
    assert any(r.startswith("exact") for r in p.reasons)
    assert any("tok/s at 8,192 tokens" in r for r in p.reasons)
    assert p.kv_bytes == cost.kv_bytes(known_spec("llama-3-8b"), KVPolicy(), 8192)


def test_memory_pressure_walks_down_fp16_int8_k8v4_int4_with_reasons():
    spec = known_spec("llama-3.1-70b-q4")
    hw = detect.named("m2-max-64gb")
    choices = [str(plan(hw, spec, PlanRequest(context=c), EVERYTHING).policy) for c in (4096, 24576, 32768, 40960)]
    assert choices == ["fp16", "int8", "k8v4", "int4+res128"]  # keys keep 8 bits before they drop to 4
    p = plan(hw, spec, PlanRequest(context=40960), EVERYTHING)
    assert [r.policy for r in p.rejected] == ["fp16", "int8", "k8v4"]
    assert all("over the" in r.reason and "budget" in r.reason for r in p.rejected)


def test_past_the_trained_context_the_plan_is_sinks_plus_a_window_inside_it():
    p = plan(CPU, SMOL, PlanRequest(context=16384), EVERYTHING)
    assert p.policy.evicts and p.policy.sinks == 4 and not p.policy.quantized
    assert p.policy.capacity() <= SMOL.context_length
    assert p.policy.capacity() == SMOL.context_length // 2  # llama.cpp's n_ctx stays a multiple of 256
    assert any("trained on" in r.reason for r in p.rejected if r.policy == "fp16")
    assert any(r.startswith("lossy") and "default cap" in r for r in p.reasons)


def test_max_memory_caps_the_budget_and_can_force_a_window():
    spec = known_spec("llama-3-8b-q4")
    hw = detect.named("rtx4090")
    roomy = plan(hw, spec, PlanRequest(context=8192), EVERYTHING)
    tight = plan(hw, spec, PlanRequest(context=8192, max_memory=parse_size("6.5GB")), EVERYTHING)
    assert roomy.exact and not tight.exact
    b = budget(hw, spec, PlanRequest(max_memory=parse_size("6.5GB")), EVERYTHING)
    assert b.limited_by == "--max-memory" and tight.kv_bytes <= b.kv


def test_exact_flag_refuses_rather_than_going_lossy():
    with pytest.raises(NoPlanFits, match="no exact plan.*drop --exact") as err:
        plan(CPU, SMOL, PlanRequest(context=16384, exact=True), EVERYTHING)
    assert {r.policy for r in err.value.rejected} >= {"fp16", "int8"}
    assert any("--exact" in r.reason for r in err.value.rejected)


def test_a_model_whose_weights_do_not_fit_is_refused_with_the_sizes():
    with pytest.raises(NoPlanFits, match="does not fit.*weights 15.0 GiB"):
        plan(detect.named("m1-8gb"), known_spec("llama-3-8b"), PlanRequest(), EVERYTHING)


def test_calibrated_quantized_kv_that_decodes_slower_loses_to_a_window_under_a_speed_target():
    # fp16 fits at 8K but is too slow for the target; int4 has fewer bytes but costs 12× per byte here,
    # so the planner must not take it for speed: it keeps fp16 and shrinks the window instead.
    speed = SpeedModel(CPU, synthetic_calibration())
    target = 100.0
    p = plan(CPU, SMOL, PlanRequest(context=8192, min_tok_s=target), EVERYTHING, speed)
    assert p.policy.evicts and not p.policy.quantized
    assert speed.worst_decode_tok_s(SMOL, p.policy, 10**6) >= target
    too_slow = {r.policy for r in p.rejected if "--min-tok-s" in r.reason}
    assert {"fp16", "int8", "int4"} <= too_slow
    cost_line = next(r for r in p.reasons if r.startswith("speed target 100 tok/s met"))
    assert (f"it cost exactness, the cache keeps {p.policy.capacity():,} tokens instead of the whole context: "
            "without the target the plan is fp16 at ≈") in cost_line
    assert any("bound by --min-tok-s 100" in r for r in p.reasons)


def test_past_the_trained_context_the_speed_target_costs_window_size_and_says_so():
    speed = SpeedModel(CPU, synthetic_calibration())
    free = plan(CPU, SMOL, PlanRequest(context=16384), EVERYTHING, speed)
    fast = plan(CPU, SMOL, PlanRequest(context=16384, min_tok_s=100), EVERYTHING, speed)
    assert free.policy.evicts and fast.policy.evicts and fast.policy.capacity() < free.policy.capacity()
    cost_line = next(r for r in fast.reasons if r.startswith("speed target 100 tok/s met"))
    assert (f"it cost the cache keeps {fast.policy.capacity():,} tokens instead of {free.policy.capacity():,}: "
            f"without the target the plan is {free.policy} at ≈") in cost_line
    slow_enough = plan(CPU, SMOL, PlanRequest(context=16384, min_tok_s=1), EVERYTHING, speed)
    assert slow_enough.policy == free.policy
    assert any("met with no compromise (the plan without it is the same)" in r for r in slow_enough.reasons)


def test_without_a_calibration_quantized_kv_is_not_assumed_faster():
    speed = SpeedModel(CPU)
    for n in (1024, 8192):
        assert speed.decode_tok_s(SMOL, KVPolicy(k_bits=4, v_bits=4), n) <= speed.decode_tok_s(SMOL, KVPolicy(), n)


def test_an_unreachable_speed_target_is_refused():
    speed = SpeedModel(CPU, synthetic_calibration())
    with pytest.raises(NoPlanFits, match="lower --context or --min-tok-s"):
        plan(CPU, SMOL, PlanRequest(context=8192, min_tok_s=1000), EVERYTHING, speed)


def test_llamacpp_refusals_shape_the_plan():
    view, notes = backend_view("llamacpp", SMOL)
    assert notes == ()
    p = plan(CPU, SMOL, PlanRequest(context=16384), view)
    assert str(p.policy) == "fp16+sink4+win4092"
    reasons = {r.policy: r.reason for r in p.rejected}
    assert "residual is not supported" in reasons["int4+res128"]
    assert "requantise the quantized K cache" in reasons["int8+sink4+winN"]


def test_heavy_hitters_are_considered_only_when_asked():
    p = plan(CPU, SMOL, PlanRequest(context=16384, heavy=True), EVERYTHING)
    assert any("heavy" in r.policy for r in p.rejected) or p.policy.heavy
    assert not plan(CPU, SMOL, PlanRequest(context=16384), EVERYTHING).policy.heavy


def test_projections_cover_4k_32k_128k_up_to_the_trained_context():
    assert projection_contexts(known_spec("llama-3.1-8b"), 131072) == [4096, 32768, 131072]
    assert projection_contexts(SMOL, 8192) == [4096, 8192]
    p = plan(detect.named("rtx4090"), known_spec("llama-3.1-8b"), PlanRequest(context=32768), EVERYTHING)
    rows = projections(p, known_spec("llama-3.1-8b"), SpeedModel(detect.named("rtx4090")), [4096, 32768, 131072],
                       kv_budget=p.kv_bytes)
    assert [r.fits for r in rows] == [True, True, False]
    assert rows[0].decode_tok_s > rows[2].decode_tok_s


@pytest.mark.parametrize("text,expected", [("6GB", 6 * 10**9), ("800MiB", 800 * 2**20), ("1.5gib", 3 * 2**29),
                                           ("4096", 4096)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "-1GB", "6XB", "0"])
def test_parse_size_rejects_nonsense(bad):
    with pytest.raises(UserError, match="6GB"):
        parse_size(bad)


def test_bad_requests_are_user_errors():
    with pytest.raises(UserError, match="--context 8 is too small"):
        plan(CPU, SMOL, PlanRequest(context=8), EVERYTHING)
    with pytest.raises(UserError, match="--min-tok-s"):
        plan(CPU, SMOL, PlanRequest(min_tok_s=-5), EVERYTHING)
