"""kvcache/decode_traffic.py: the bytes a decode step moves, split into codes, scales, full-precision
tokens, queries and outputs; its KV part is the cost model's, and the speed model uses it."""
import pytest

from localctx.kvcache import cost, decode_traffic, known_models
from localctx.kvcache.hardware_profile import HardwareProfile
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.speed import SpeedModel

LLAMA3_8B = ModelSpec("Llama-3-8B", "llama", n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_size=4096,
                      vocab_size=128256, context_length=8192)
POLICIES = ["fp16", "int8", "int4+res128", "int4+g64+res64", "k8v4", "kf16v4", "int4+sink4+win1024",
            "fp16+sink4+win4096", "int8+sink4+win512+heavy64"]


def test_llama3_8b_int4_at_32k_by_hand():
    """int4+res128 after 32,768 tokens: the head group (32) and the 128-token residual stay fp16, so
    32,768 − 32 − 128 = 32,608 tokens are quantized (1,019 groups of 32); per layer and token, codes are
    2 × 1,024 channels × ½ byte and scales 2 × 32 groups × (scale + min) × 2 bytes."""
    t = decode_traffic.step_traffic(LLAMA3_8B, KVPolicy.parse("int4+res128"), 32768)
    assert t.codes == 32 * 32_608 * 1024
    assert t.scales == 32 * 32_608 * 256
    assert t.full_tokens == 32 * 160 * 4096
    assert t.queries == t.outputs == 32 * 32 * 128 * 2
    assert t.sdpa_kv == 32 * 32768 * 4096
    assert t.total == t.codes + t.scales + t.full_tokens + 2 * t.queries
    assert 0.31 < t.kv / t.sdpa_kv < 0.32  # 1,280 of 4,096 bytes per token and layer


@pytest.mark.parametrize("text", POLICIES)
@pytest.mark.parametrize("n", [0, 1, 100, 4096, 40_000])
@pytest.mark.parametrize("model", ["llama-3-8b", "qwen2.5-7b", "gemma-3-4b"])
def test_kv_part_is_the_cost_model(model, text, n):
    spec = known_models.known_spec(model)
    assert spec is not None
    policy = KVPolicy.parse(text)
    t = decode_traffic.step_traffic(spec, policy, n)
    assert t.kv == cost.kv_bytes(spec, policy, n)
    assert t.sdpa_kv == cost.full_precision_equivalent(spec, policy, n)
    assert min(t.codes, t.scales, t.full_tokens) >= 0
    if not KVPolicy.parse(text).quantized:
        assert t.codes == t.scales == 0


def test_speed_model_reads_the_same_bytes():
    hw = HardwareProfile(kind="cuda", name="RTX 4090", memory_bytes=24 << 30, free_bytes=24 << 30,
                         bandwidth_bytes_s=1008e9, bandwidth_source="profile", compute_flops=1e14)
    spec = known_models.known_spec("llama-3-8b")
    for text in ("fp16", "int4+res128"):
        policy = KVPolicy.parse(text)
        t = decode_traffic.step_traffic(spec, policy, 32768)
        step = SpeedModel(hw).step_seconds(spec, policy, 32768)
        # uncalibrated: quantized KV is projected no faster than SDPA's fp16 bytes (no GPU has measured it)
        assert step == pytest.approx((spec.decode_weight_bytes + max(t.kv, t.sdpa_kv)) / 1008e9, rel=1e-12)
