"""The cost model per layer: sliding layers hold at most their window, a policy window applies only
where it is smaller, layers without attention hold nothing, K and V head dims apart, and a mixture
of experts reads its dense weights plus the active experts per decoded token."""
from dataclasses import replace

from localctx.kvcache import cost
from localctx.kvcache.hardware_profile import HardwareProfile
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import FULL, NONE, SLIDING, LayerAttention, ModelSpec, MoE
from localctx.kvcache.speed import SpeedModel

FULL_L = LayerAttention(FULL, 2, 64, 64)
SLIDE_L = LayerAttention(SLIDING, 2, 64, 64, window=512)
PER_TOKEN = 2 * 2 * 64 * 2  # K and V, 2 heads × 64, fp16


def spec_of(*layers, **kw) -> ModelSpec:
    return ModelSpec("t", "test", len(layers), 8, 2, 64, 512, 1000, 32768, layers=tuple(layers), **kw)


def test_a_sliding_layer_holds_min_of_tokens_and_its_window():
    spec = spec_of(SLIDE_L, FULL_L)
    fp16 = KVPolicy()
    assert cost.kv_bytes(spec, fp16, 300) == 2 * 300 * PER_TOKEN
    assert cost.kv_bytes(spec, fp16, 10_000) == (512 + 10_000) * PER_TOKEN
    assert cost.max_kv_bytes(spec, fp16, 10_000) == (512 + 10_000) * PER_TOKEN


def test_a_policy_window_applies_on_top_only_where_it_is_smaller():
    spec = spec_of(SLIDE_L, FULL_L)
    small, large = KVPolicy.parse("fp16+sink4+win256"), KVPolicy.parse("fp16+sink4+win4096")
    assert cost.kv_bytes(spec, small, 10_000) == 2 * 260 * PER_TOKEN  # the policy is the smaller everywhere
    assert cost.kv_bytes(spec, large, 10_000) == (512 + 4100) * PER_TOKEN  # the model's window on its layer
    assert cost.layer_policy(large, SLIDE_L).window == 512 and cost.layer_policy(small, SLIDE_L) is small


def test_layers_without_attention_hold_nothing():
    spec = spec_of(LayerAttention(NONE), LayerAttention(NONE), FULL_L)
    assert cost.kv_bytes(spec, KVPolicy(), 1000) == 1000 * PER_TOKEN
    assert cost.full_bytes_per_token(spec) == PER_TOKEN


def test_k_and_v_head_dims_are_counted_apart():
    spec = spec_of(LayerAttention(FULL, 1, 192, 128))  # an MLA-like split: K 192, V 128
    assert cost.kv_bytes(spec, KVPolicy(), 10) == 10 * (192 + 128) * 2
    assert cost.quant_bytes_per_token(spec, 8, 8, 32) == 320 + 320 // 32 * 4


def test_quantized_sliding_layers_follow_the_cache_rules_of_a_window():
    spec = spec_of(SLIDE_L)
    int8 = KVPolicy(k_bits=8, v_bits=8)
    as_window = replace(int8, window=512)
    for n in (100, 600, 5000):
        assert cost.kv_bytes(spec, int8, n) == cost.kv_bytes(spec_of(FULL_L), as_window, n)


def test_gemma_3_27b_at_128k_is_about_a_sixth_of_all_full_attention():
    spec = known_spec("gemma-3-27b")
    every_full = replace(spec, layers=())
    exact, naive = cost.max_kv_bytes(spec, KVPolicy(), 131072), cost.max_kv_bytes(every_full, KVPolicy(), 131072)
    per_layer_token = 2 * 16 * 128 * 2
    assert exact == per_layer_token * (10 * 131072 + 52 * 1024)
    assert 5.5 < naive / exact < 6.2


def test_moe_decode_reads_dense_weights_plus_active_experts():
    moe = MoE(n_experts=128, n_active=8, expert_bytes=56_000_000_000, expert_params=28_000_000_000)
    spec = spec_of(FULL_L, weight_bytes=61_000_000_000, n_params=30_500_000_000, moe=moe)
    assert spec.decode_weight_bytes == 5_000_000_000 + 3_500_000_000
    hw = HardwareProfile(kind="cuda", name="x", memory_bytes=24 << 30, free_bytes=24 << 30,
                         bandwidth_bytes_s=1e12, bandwidth_source="profile", compute_flops=1e14)
    step = SpeedModel(hw).step_seconds(spec, KVPolicy(), 1000)
    assert abs(step - (8_500_000_000 + 1000 * PER_TOKEN) / 1e12) < 1e-12
    assert spec.active_params == 2_500_000_000 + 1_750_000_000
