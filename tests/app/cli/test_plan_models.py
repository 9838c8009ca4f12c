"""`localctx plan` for the models people run: sliding-window and MoE shapes with exact KV bytes,
planning without weights (a config.json folder, a hub repo's config.json), and `localctx models`."""
import json
from dataclasses import replace

from gguf_tiny import ARCHS, write

from localctx.backends.llamacpp.shift import settings_for_policy
from localctx.kvcache import cost
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.policy import KVPolicy


def plan_json(cli, *args):
    r = cli("plan", *args, "--json")
    assert r.code == 0, r.err
    return json.loads(r.out)


def test_gemma_3_27b_on_a_4090_at_128k_counts_sliding_layers_at_their_window(cli):
    out = plan_json(cli, "-m", "gemma-3-27b", "--hardware", "rtx4090", "--context", "131072", "--backend", "llamacpp")
    spec = known_spec("gemma-3-27b")
    plan = out["plan"]
    policy = KVPolicy.parse(plan["policy"])
    assert plan["kv_bytes"] == settings_for_policy(policy, 131072).cache().bytes(spec)  # what llama.cpp allocates
    assert any("52 of 62 layers slide over 1,024 tokens" in r for r in plan["reasons"])
    every_layer_full = replace(spec, layers=())
    assert plan["kv_bytes"] < cost.max_kv_bytes(every_layer_full, policy, 131072) / 4
    assert len(out["model"]["layers"]) == 62 and out["model"]["layers"][5]["kind"] == "full"
    exact = cost.max_kv_bytes(spec, KVPolicy(), 131072)  # the cost model's fp16 bytes, layer by layer
    assert exact == 2 * 16 * 128 * 2 * (10 * 131072 + 52 * 1024)


def test_qwen3_30b_a3b_projects_decode_from_its_active_experts(cli):
    out = plan_json(cli, "-m", "qwen3-30b-a3b", "--hardware", "rtx4090", "--context", "32768", "--backend", "llamacpp")
    spec = known_spec("qwen3-30b-a3b")
    assert out["model"]["moe"]["n_active"] == 8 and out["model"]["moe"]["n_experts"] == 128
    assert spec.decode_weight_bytes < spec.weight_bytes / 5
    dense_like = plan_json(cli, "-m", "qwen2.5-32b-q4", "--hardware", "rtx4090", "--context", "32768",
                           "--backend", "llamacpp")
    # similar file sizes; the MoE reads an eighth of its experts per token and decodes several times faster
    assert out["plan"]["decode_tok_s"] > 3 * dense_like["plan"]["decode_tok_s"]
    assert any("8 of 128 experts" in r for r in out["plan"]["reasons"])


def test_a_folder_with_only_config_json_plans(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "hidden_size": 640, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 2048,
        "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512,
        "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "tie_word_embeddings": True}))
    r = cli("plan", "-m", str(tmp_path), "--hardware", "cpu-24gb", "--backend", "llamacpp", "--context", "8192")
    assert r.code == 0, r.err
    assert "attention 5 local : 1 global, window 512" in r.out
    assert "assumed   no weights in" in r.out


def test_a_hub_repo_plans_from_its_config_json_alone(cli, tmp_path, monkeypatch):
    import huggingface_hub

    fetched = []
    config = tmp_path / "snap" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
                                  "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                                  "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
                                  "max_position_embeddings": 40960, "tie_word_embeddings": True}))

    def fake_download(repo, filename, **kw):
        fetched.append((repo, filename))
        return str(config)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    out = plan_json(cli, "-m", "someorg/tiny-qwen3", "--hardware", "rtx4090")
    assert fetched == [("someorg/tiny-qwen3", "config.json")]  # only the config, never weights
    assert out["model_source"] == "config.json of someorg/tiny-qwen3 (no weights needed)"
    assert out["model"]["n_layers"] == 28


def test_offline_a_hub_repo_is_one_line_error(cli):
    r = cli("plan", "-m", "someorg/not-cached", "--hardware", "rtx4090")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1
    assert "HF_HUB_OFFLINE" in r.err


def test_models_shows_attention_layout_and_backends(cli, tmp_path):
    write(tmp_path / "g.gguf", ARCHS["gemma3"])
    write(tmp_path / "l.gguf", ARCHS["llama"])
    r = cli("models", str(tmp_path), "--json")
    assert r.code == 0, r.err
    rows = {row["path"].rsplit("/", 1)[-1]: row for row in json.loads(r.out)}
    assert rows["g.gguf"]["attention"] == "5 local : 1 global, window 512"
    assert "llamacpp" in rows["g.gguf"]["backends"]
    assert rows["l.gguf"]["attention"] == "full attention" and "torch" in rows["l.gguf"]["backends"]
    text = cli("models", str(tmp_path)).out
    assert "5 local : 1 global, window 512" in text
