"""Tiny random-weight GGUFs of several architectures, written with the gguf package's writer: the
metadata keys and tensor names llama.cpp expects (its src/models/<arch>.cpp ``load_arch_tensors``),
so llama.cpp loads them and reports its KV allocation. Weights are random; only shapes matter."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SPECIALS = ["<bos>", "<eos>", "<pad>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n")]
TEMPLATE = ("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '</s>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")


def _byte_chars() -> list[str]:
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def vocab() -> list[str]:
    return _byte_chars() + [a + b for a, b in MERGES] + SPECIALS


@dataclass(frozen=True)
class TinyGGUF:
    arch: str
    n_layers: int = 4
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ff: int = 96
    context: int = 8192
    sliding_window: int | None = None
    swa_pattern: int | None = None  # written as {arch}.attention.sliding_window_pattern where given
    n_experts: int = 0
    n_active: int = 0
    extra: dict = field(default_factory=dict)
    tokenizer_pre: str = "default"  # llama.cpp's pre-tokenizer name (the torch backend knows gpt2, not default)

    @property
    def has_qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3moe", "gemma3")

    @property
    def gemma(self) -> bool:
        return self.arch in ("gemma2", "gemma3")


ARCHS = {
    "llama": TinyGGUF("llama"),
    "qwen2": TinyGGUF("qwen2", head_dim=16),  # qwen2's attn_output is n_embd × n_embd: heads × dim = hidden
    "qwen3": TinyGGUF("qwen3", head_dim=32),  # head dim apart from hidden / heads
    "gemma3": TinyGGUF("gemma3", n_layers=6, n_kv_heads=1, head_dim=32, sliding_window=512),
    "gemma2": TinyGGUF("gemma2", n_layers=4, sliding_window=256),
    "qwen3moe": TinyGGUF("qwen3moe", n_experts=8, n_active=2, ff=32),
}


def write(path: Path, cfg: TinyGGUF, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    tokens = vocab()
    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_name(f"tiny-{cfg.arch}")
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.context)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if cfg.swa_pattern:
        w.add_uint32(f"{cfg.arch}.attention.sliding_window_pattern", cfg.swa_pattern)
    if cfg.n_experts:
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.n_active)
        w.add_expert_feed_forward_length(cfg.ff)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(cfg.tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(tokens.index("<bos>"))
    w.add_eos_token_id(tokens.index("<eos>"))
    w.add_chat_template(TEMPLATE)

    def tensor(name: str, *shape: int) -> None:  # numpy order: the reverse of ggml's ne
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    E, V, D, F = cfg.hidden, len(tokens), cfg.head_dim, cfg.ff
    tensor("token_embd.weight", V, E)
    tensor("output_norm.weight", E)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", E)
        tensor(b + "attn_q.weight", cfg.n_heads * D, E)
        tensor(b + "attn_k.weight", cfg.n_kv_heads * D, E)
        tensor(b + "attn_v.weight", cfg.n_kv_heads * D, E)
        tensor(b + "attn_output.weight", E, cfg.n_heads * D)
        if cfg.has_qk_norm:
            tensor(b + "attn_q_norm.weight", D)
            tensor(b + "attn_k_norm.weight", D)
        if cfg.gemma:
            tensor(b + "post_attention_norm.weight", E)
            tensor(b + "post_ffw_norm.weight", E)
        tensor(b + "ffn_norm.weight", E)
        if cfg.n_experts:
            tensor(b + "ffn_gate_inp.weight", cfg.n_experts, E)
            tensor(b + "ffn_gate_exps.weight", cfg.n_experts, F, E)
            tensor(b + "ffn_up_exps.weight", cfg.n_experts, F, E)
            tensor(b + "ffn_down_exps.weight", cfg.n_experts, E, F)
        else:
            tensor(b + "ffn_gate.weight", F, E)
            tensor(b + "ffn_up.weight", F, E)
            tensor(b + "ffn_down.weight", E, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_every_type(path, endian="little", n_tokens=300):
    """A tiny GGUF with a metadata value of every type, arrays of several kinds, the tokenizer's big
    arrays, and tensors of a plain, a half and a block-quantised type (2-D and 3-D)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama",
                        endianess=gguf.GGUFEndian.BIG if endian == "big" else gguf.GGUFEndian.LITTLE)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1.0 / 3.0)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo {{ messages }}")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strs", ["a", "", "ünïcode"])
    w.add_array("t.empty", [])
    w.add_block_count(2)
    w.add_context_length(64)
    tokens = [f"tok{i}" for i in range(n_tokens)] + ["<|im_end|>"]
    w.add_token_list(tokens)
    w.add_token_types([1] * n_tokens + [3])
    w.add_token_scores([float(i) / 7 for i in range(n_tokens + 1)])
    w.add_token_merges(["t o", "to k"])
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    rng = np.random.default_rng(0)
    w.add_tensor("f32.weight", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16.weight", rng.standard_normal((2, 4, 16)).astype(np.float16))
    q8 = rng.integers(0, 255, size=(4, 2 * 34), dtype=np.uint8)  # 4 rows of 64 Q8_0 elements
    w.add_tensor("q8.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
