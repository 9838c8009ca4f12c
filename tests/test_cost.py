from localctx.kvcache import cost
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.spec import ModelSpec

SMOLLM2 = ModelSpec("SmolLM2-135M", "llama", n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden_size=576,
                    vocab_size=49152, context_length=8192)
LLAMA3_8B = ModelSpec("Llama-3-8B", "llama", n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_size=4096,
                      vocab_size=128256, context_length=8192)
MIB = 2 ** 20


def test_smollm2_fp16_at_8k_is_180_mib_as_llama_cpp_reports():
    assert cost.kv_bytes(SMOLLM2, KVPolicy(), 8192) == 180 * MIB


def test_llama3_8b_bf16_is_131072_bytes_per_token_and_16_gib_at_128k():
    assert cost.kv_bytes_per_token(LLAMA3_8B, KVPolicy()) == 131_072
    assert cost.kv_bytes(LLAMA3_8B, KVPolicy(), 128 * 1024) == 16 * 2 ** 30


def test_quantized_bytes_count_payload_and_group_scales():
    # int8, groups of 32: 1 byte per element + (scale + min) fp16 per 32 elements
    elems = cost.kv_elements_per_token(SMOLLM2)
    assert cost.kv_bytes_per_token(SMOLLM2, KVPolicy(bits=8)) == elems + elems // 32 * 4
    assert cost.kv_bytes_per_token(SMOLLM2, KVPolicy(bits=4, group_size=64)) == elems // 2 + elems // 64 * 4


def test_window_bounds_the_bytes():
    policy = KVPolicy.parse("fp16+sink4+win1024")
    per = cost.kv_bytes_per_token(SMOLLM2, policy)
    assert cost.kv_bytes(SMOLLM2, policy, 100) == 100 * per
    assert cost.kv_bytes(SMOLLM2, policy, 20_000) == 1028 * per
    assert cost.max_kv_bytes(SMOLLM2, policy, 20_000) == 1028 * per


def test_residual_stays_full_precision_until_a_group_ages_out():
    policy = KVPolicy.parse("int4+res128")
    full = cost.full_bytes_per_token(SMOLLM2)
    assert cost.kv_bytes(SMOLLM2, policy, 100) == 100 * full
    q = cost.quant_bytes_per_token(SMOLLM2, 4, 32)
    assert cost.kv_bytes(SMOLLM2, policy, 128 + 32) == 32 * q + 128 * full


def test_roofline_reads_weights_once_per_step_for_the_batch():
    one = cost.decode_tok_s_roofline(100e9, weight_bytes=10**9, kv_read_bytes=0)
    eight = cost.decode_tok_s_roofline(100e9, weight_bytes=10**9, kv_read_bytes=0, batch=8)
    assert one == 100 and eight == 800


def test_format_bytes():
    assert cost.format_bytes(180 * MIB) == "180.0 MiB"
    assert cost.format_bytes(512) == "512 B"
