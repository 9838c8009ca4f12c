"""The cost model's worked numbers and its quantized / evicting accounting."""
import pytest

from localctx.kvcache import cost
from localctx.kvcache.eviction import held_counts
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec

SMOLLM2 = ModelSpec("SmolLM2-135M", "llama", n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden_size=576,
                    vocab_size=49152, context_length=8192)
LLAMA3_8B = ModelSpec("Llama-3-8B", "llama", n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_size=4096,
                      vocab_size=128256, context_length=8192)
MIB = 2 ** 20


def test_smollm2_fp16_at_8k_is_180_mib():
    assert cost.kv_bytes(SMOLLM2, KVPolicy(), 8192) == 180 * MIB


def test_llama3_8b_bf16_is_131072_bytes_per_token_and_16_gib_at_128k():
    assert cost.kv_bytes_per_token(LLAMA3_8B, KVPolicy()) == 131_072
    assert cost.kv_bytes(LLAMA3_8B, KVPolicy(), 128 * 1024) == 16 * 2 ** 30


def test_quantized_bytes_per_token_count_payload_and_fp16_scale_and_min_per_group():
    elems = cost.kv_elements_per_token(SMOLLM2)  # 11,520
    assert cost.quant_bytes_per_token(SMOLLM2, 8, 8, 32) == 11_520 + 360 * 4
    assert cost.quant_bytes_per_token(SMOLLM2, 4, 4, 64) == elems // 2 + elems // 64 * 4
    # the policy's per-token bytes are the same figures
    assert cost.kv_bytes_per_token(SMOLLM2, KVPolicy(k_bits=8, v_bits=8)) == elems + elems // 32 * 4
    assert cost.kv_bytes_per_token(SMOLLM2, KVPolicy(k_bits=4, v_bits=4, group_size=64)) == elems // 2 + elems // 64 * 4


def test_residual_stays_full_precision_until_a_whole_group_ages_out():
    """Without a window the head (the first group, tokens 0..31) is never quantized; group 1
    (tokens 32..63) is once all of it is older than the 128-token residual."""
    policy = KVPolicy.parse("int4+res128")
    full, q = cost.full_bytes_per_token(SMOLLM2), cost.quant_bytes_per_token(SMOLLM2, 4, 4, 32)
    assert cost.kv_bytes(SMOLLM2, policy, 100) == 100 * full
    assert cost.kv_bytes(SMOLLM2, policy, 128 + 32) == 160 * full  # group 0 aged out: the head stays
    assert cost.kv_bytes(SMOLLM2, policy, 128 + 63) == 191 * full
    assert cost.kv_bytes(SMOLLM2, policy, 128 + 64) == 32 * q + (32 + 128) * full
    # 1000 tokens: groups 0..26 are older than the residual (27 * 32 = 864 <= 872); 1..26 quantized
    assert cost.split_tokens(policy, 1000) == (832, 168)


def test_sinks_stay_full_precision_and_groups_align_after_them():
    policy = KVPolicy.parse("int8+sink4")
    # main tokens 0..31 are the head; group 1 (main 32..63) is quantized
    assert cost.split_tokens(policy, 4 + 64 + 5) == (32, 4 + 32 + 5)
    assert cost.split_tokens(policy, 4 + 96) == (64, 4 + 32)


def test_only_an_unbounded_quantized_cache_keeps_a_full_precision_head():
    assert held_counts(KVPolicy.parse("int4"), 96).quant_groups == 2
    assert held_counts(KVPolicy.parse("int4+g64"), 128).quant_groups == 1
    # with a window the sinks keep the first tokens; the first group is quantized like the rest
    assert held_counts(KVPolicy.parse("int4+win4096"), 96).quant_groups == 3
    assert held_counts(KVPolicy.parse("int4+sink4+win4096"), 100).quant_groups == 3


def test_window_bounds_the_bytes():
    policy = KVPolicy.parse("fp16+sink4+win1024")
    per = cost.kv_bytes_per_token(SMOLLM2, policy)
    assert cost.kv_bytes(SMOLLM2, policy, 100) == 100 * per
    assert cost.kv_bytes(SMOLLM2, policy, 20_000) == 1028 * per
    assert cost.max_kv_bytes(SMOLLM2, policy, 20_000) == 1028 * per


def test_quantized_window_evicts_whole_groups():
    policy = KVPolicy.parse("int4+sink4+win2048")
    # 20,000 tokens: 19,996 main; groups 0..624 formed; the window starts at main 17,948 = group 560 + 28
    held = held_counts(policy, 20_000)
    assert (held.sink_tokens, held.full_tokens, held.quant_groups) == (4, 28, 64)
    assert held.tokens == 4 + 28 + 2048
    peak = cost.max_kv_bytes(SMOLLM2, policy, 1_000_000)
    assert all(cost.kv_bytes(SMOLLM2, policy, n) <= peak for n in range(0, 5000, 7))


def test_window_smaller_than_residual_plus_group_never_quantizes():
    policy = KVPolicy.parse("int4+res128+win100")
    assert cost.split_tokens(policy, 10_000) == (0, 100)


@pytest.mark.parametrize("text,n,held", [
    ("fp16+win64+heavy10", 5000, 64 + 10),
    # 5000 main tokens, 156 groups formed + 8 full; groups 153.. reach the window (153*32 = 4896 > 5000-96-32);
    # heavy40 → 2 whole groups
    ("int8+win96+heavy40", 5000, 3 * 32 + 8 + 2 * 32),
])
def test_heavy_hitters_add_their_budget_once_the_window_is_full(text, n, held):
    policy = KVPolicy.parse(text)
    assert cost.held_tokens(policy, 50) == 50
    assert cost.held_tokens(policy, n) == held


def test_roofline_reads_weights_once_per_step_for_the_batch():
    one = cost.decode_tok_s_roofline(100e9, weight_bytes=10**9, kv_read_bytes=0)
    eight = cost.decode_tok_s_roofline(100e9, weight_bytes=10**9, kv_read_bytes=0, batch=8)
    assert one == 100 and eight == 800


def test_format_bytes():
    assert cost.format_bytes(180 * MIB) == "180.0 MiB"
    assert cost.format_bytes(512) == "512 B"
