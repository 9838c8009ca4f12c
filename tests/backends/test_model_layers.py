"""ModelSpec per layer: read from GGUF metadata (tiny random-weight GGUFs) and from config.json, its
dict round trip, the layout line, and the architectures the reader does not know."""
import json

import pytest
from gguf_tiny import ARCHS, TinyGGUF, write

from localctx.backends.models.spec_reader import gguf_spec, hf_spec
from localctx.kvcache.model_spec import FULL, NONE, SLIDING, LayerAttention, ModelSpec, describe_layout


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ggufs")
    return {name: write(folder / f"{name}.gguf", cfg) for name, cfg in ARCHS.items()}


def kinds(spec: ModelSpec) -> str:
    return "".join({FULL: "F", SLIDING: "S", NONE: "-"}[layer.kind] for layer in spec.attention())


def test_dense_architectures_are_full_attention_with_their_heads_and_dims(ggufs):
    llama, qwen3 = gguf_spec(ggufs["llama"]), gguf_spec(ggufs["qwen3"])
    assert kinds(llama) == "FFFF" and not llama.assumptions and llama.moe is None
    assert llama.attention()[0] == LayerAttention(FULL, 2, 16, 16)
    assert qwen3.attention()[0] == LayerAttention(FULL, 2, 32, 32)  # head dim 32 ≠ hidden 64 / 4 heads
    assert gguf_spec(ggufs["qwen2"]).attention()[3] == LayerAttention(FULL, 2, 16, 16)


def test_gemma3_slides_on_five_of_six_layers_as_llama_cpp_fixes_it(ggufs):
    spec = gguf_spec(ggufs["gemma3"])
    assert kinds(spec) == "SSSSSF"
    assert spec.attention()[0] == LayerAttention(SLIDING, 1, 32, 32, window=512)
    assert describe_layout(spec) == "5 local : 1 global, window 512"


def test_gemma2_alternates_starting_with_a_sliding_layer(ggufs):
    spec = gguf_spec(ggufs["gemma2"])
    assert kinds(spec) == "SFSF" and spec.attention()[0].window == 256
    assert describe_layout(spec) == "1 local : 1 global, window 256"


def test_a_gguf_pattern_key_overrides_the_architecture_default(tmp_path):
    spec = gguf_spec(write(tmp_path / "g.gguf", TinyGGUF("gemma3", n_layers=6, sliding_window=128, swa_pattern=3)))
    assert kinds(spec) == "SSFSSF"


def test_moe_reads_experts_active_experts_and_the_bytes_a_token_reads(ggufs, tmp_path):
    from gguf import GGUFReader

    spec = gguf_spec(ggufs["qwen3moe"])
    reader = GGUFReader(str(ggufs["qwen3moe"]))
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    assert (spec.moe.n_experts, spec.moe.n_active, spec.moe.expert_bytes) == (8, 2, experts)
    assert spec.decode_weight_bytes == spec.weight_bytes - experts + experts * 2 // 8
    assert spec.decode_weight_bytes < spec.weight_bytes


def test_an_unknown_architecture_is_read_as_full_attention_and_says_so(tmp_path):
    spec = gguf_spec(write(tmp_path / "m.gguf", TinyGGUF("mystery")))
    assert kinds(spec) == "FFFF"
    assert len(spec.assumptions) == 1 and "'mystery' is not known" in spec.assumptions[0]


def test_round_trip_through_dict_and_json(ggufs):
    for name in ("gemma3", "qwen3moe", "llama"):
        spec = gguf_spec(ggufs[name])
        assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_a_spec_without_layers_reads_as_uniform_full_attention():
    spec = ModelSpec("m", "llama", 3, 8, 2, 64, 512, 100, 4096)
    assert spec.attention() == (LayerAttention(FULL, 2, 64, 64),) * 3
    assert ModelSpec.from_dict({**spec.to_dict(), "unknown_field": 1}) == spec
    with pytest.raises(ValueError):
        ModelSpec("m", "llama", 3, 8, 2, 64, 512, 100, 4096, layers=(LayerAttention(),))


def _config(folder, **extra):
    base = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 640, "num_hidden_layers": 18,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 2048,
            "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512,
            "torch_dtype": "bfloat16"}
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**base, **extra}))
    return folder


def test_config_json_layer_types_and_pattern(tmp_path):
    by_pattern = hf_spec(_config(tmp_path / "a", sliding_window_pattern=6))
    types = ["sliding_attention"] * 5 + ["full_attention"]
    by_types = hf_spec(_config(tmp_path / "b", layer_types=types * 3))
    assert kinds(by_pattern) == kinds(by_types) == "SSSSSF" * 3
    assert by_types.attention()[0] == LayerAttention(SLIDING, 1, 256, 256, window=512)


def test_qwen2_sliding_window_without_use_sliding_window_slides_nowhere(tmp_path):
    spec = hf_spec(_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32768,
                           use_sliding_window=False, head_dim=64))
    assert set(kinds(spec)) == {"F"}


def test_config_only_folder_plans_with_weights_from_its_shapes(tmp_path):
    spec = hf_spec(_config(tmp_path, architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=64, sliding_window=None))
    assert spec.weight_bytes == 2 * spec.n_params and "no weights" in spec.assumptions[0]
    assert spec.moe.n_experts == 8 and spec.moe.expert_params == 18 * 8 * 3 * 640 * 64
    assert spec.active_params == spec.n_params - spec.moe.expert_params * 6 // 8
