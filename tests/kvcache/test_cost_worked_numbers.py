"""The cost model's worked numbers (docs/architecture.md "Cost model"), on the shapes in assets/models.json."""
from localctx.kvcache import cost
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.policy import KVPolicy

FP16 = KVPolicy()
GiB, MiB = 2 ** 30, 2 ** 20


def test_llama3_8b_bf16_131072_bytes_per_token_and_16_gib_at_128k():
    spec = known_spec("llama-3-8b")
    assert (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.kv_elem_bytes) == (32, 8, 128, 2)
    assert cost.kv_bytes_per_token(spec, FP16) == 131_072
    assert cost.kv_bytes(spec, FP16, 128 * 1024) == 16 * GiB


def test_70b_with_8_kv_heads_is_a_third_of_a_megabyte_per_token_and_42_gb_at_128k():
    spec = known_spec("llama-3.1-70b-q4")
    per_token = cost.kv_bytes_per_token(spec, FP16)
    assert per_token == 327_680 and round(per_token / 1e6, 2) == 0.33
    at_128k = cost.kv_bytes(spec, FP16, 128 * 1024)
    assert 42e9 <= at_128k < 43e9  # ≈ 42 GB (40 GiB)


def test_70b_class_without_gqa_64_kv_heads_is_2_6_mb_per_token():
    spec = known_spec("llama-65b-q4")
    assert spec.n_kv_heads == 64
    assert round(cost.kv_bytes_per_token(spec, FP16) / 1e6, 1) == 2.6


def test_smollm2_fp16_at_8192_tokens_is_180_mib():
    spec = known_spec("smollm2-135m")
    assert cost.kv_bytes(spec, FP16, 8192) == 180 * MiB


def test_known_spec_matches_the_bundled_gguf(smollm2_path):
    from localctx.backends.models.spec_reader import gguf_spec

    real = gguf_spec(smollm2_path)
    paper = known_spec("smollm2-135m")
    for field in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size", "vocab_size", "context_length",
                  "weight_bytes", "n_params"):
        assert getattr(real, field) == getattr(paper, field), field


def test_known_spec_by_hub_id_and_unknown_names():
    assert known_spec("Qwen/Qwen2.5-7B-Instruct").n_kv_heads == 4
    assert known_spec("no-such-model") is None
