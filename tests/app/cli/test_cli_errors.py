"""Bad input: one line on stderr naming the problem and the fix, exit code 2, no traceback."""
import json
import subprocess
import sys

import numpy as np
import pytest


def _tiny_gguf(path, arch="gpt2"):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _one_line_error(res, *words):
    assert res.code == 2, (res.code, res.err)
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, res.err
    assert lines[0].startswith("localctx: error:")
    assert "Traceback" not in res.err
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_model_file(cli, tmp_path):
    _one_line_error(cli("run", "-m", str(tmp_path / "nope.gguf"), "hi"), "model not found", "nope.gguf")


def test_file_that_is_not_gguf(cli, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("hello, I am text")
    _one_line_error(cli("run", "-m", str(bad), "hi"), "not a GGUF file")


def test_pickled_checkpoint_is_refused(cli, tmp_path):
    bad = tmp_path / "pytorch_model.bin"
    bad.write_bytes(b"\x80\x04\x95pickle")
    _one_line_error(cli("run", "-m", str(bad), "hi"), "pickled", "GGUF or safetensors")


@pytest.mark.parametrize("keep", [1000, 20_000_000])
def test_truncated_gguf(cli, tmp_path, smollm2_path, keep):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        cut.write_bytes(src.read(keep))
    _one_line_error(cli("run", "-m", str(cut), "hi"), "truncated or corrupt", "download it again")


def test_folder_without_config_json(cli, tmp_path):
    (tmp_path / "weights.txt").write_text("x")
    _one_line_error(cli("run", "-m", str(tmp_path), "hi"), "no config.json")


def test_gguf_llama_cpp_cannot_load_says_why(cli, tmp_path):
    path = _tiny_gguf(tmp_path / "gpt2.gguf")  # no tokenizer, no attention tensors
    _one_line_error(cli("run", "-m", str(path), "hi"), "llama.cpp cannot load gpt2.gguf (", "update it")


def test_architecture_llama_cpp_does_not_know(cli, tmp_path):
    path = _tiny_gguf(tmp_path / "mystery.gguf", arch="mystery")
    _one_line_error(cli("run", "-m", str(path), "hi"), "llama.cpp cannot load", "unknown model architecture")


def test_torch_refuses_an_architecture_its_graph_lacks(cli, tmp_path):
    from gguf_tiny import ARCHS, write

    path = write(tmp_path / "gemma2.gguf", ARCHS["gemma2"])
    _one_line_error(cli("run", "-m", str(path), "--backend", "torch", "hi"),
                    "the torch backend implements", "'gemma2'", "--backend llamacpp")


def test_unsupported_architecture_in_hf_folder(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    _one_line_error(cli("run", "-m", str(tmp_path), "hi"), "unsupported architecture")


def test_hf_folder_with_only_pickled_weights(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_attention_heads": 2, "hidden_size": 8,
        "num_hidden_layers": 1, "vocab_size": 10}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    _one_line_error(cli("run", "-m", str(tmp_path), "--backend", "torch", "hi"), "pickled")


def test_hub_repo_not_cached_while_offline(cli):
    _one_line_error(cli("run", "-m", "nobody/not-a-model", "hi"), "HF_HUB_OFFLINE", "localctx pull")


def test_empty_prompt(cli):
    _one_line_error(cli("run", "--backend", "fake", "   "), "prompt is empty")
    _one_line_error(cli("run", "--backend", "fake", stdin=""), "prompt is empty")


def test_prompt_longer_than_the_context_is_refused_not_truncated(cli):
    res = cli("run", "--backend", "fake", "--context", "64", "word " * 200)
    _one_line_error(res, "prompt is 202 tokens", "context holds 64", "windowed policy")


def test_bad_policy_and_bad_params(cli):
    _one_line_error(cli("run", "--backend", "fake", "--kv", "int3", "hi"), "unknown part 'int3'")
    _one_line_error(cli("run", "--backend", "fake", "--max-tokens", "0", "hi"), "--max-tokens")
    _one_line_error(cli("run", "--backend", "nope", "hi"), "unknown backend 'nope'")


@pytest.mark.slow
def test_prompt_longer_than_the_context_on_llamacpp(cli):
    res = cli("run", "--context", "64", "word " * 200)
    _one_line_error(res, "tokens but the context holds 64")


def test_console_script_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "localctx.app.cli", "run", "-m", str(tmp_path / "x.gguf"), "hi"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "model not found" in proc.stderr
