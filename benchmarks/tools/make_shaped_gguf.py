"""Write a GGUF with the exact shape of a real model people run (Qwen2.5 0.5B / 1.5B Instruct: layers,
widths, heads, 151,936-token vocabulary, 32K trained context, tied embeddings, q/k/v biases) and
random weights, quantized by llama.cpp's own quantizer to Q4_K_M as the Hub's files are. For the
benchmarks whose figures depend on a model's shape and not on what it says: startup wall time and
peak RSS, KV bytes, decode and prefill speed, calibration time. No model of that size can be had
offline here (docs/benchmarks.md says so); a figure made with this file says "random weights, shape
of ...", and no quality figure is ever made with it.

The tokenizer is the bundled SmolLM2's (its BPE tokens, merges and chat template), padded with
user-defined ``<|extra_N|>`` tokens to the vocabulary size, as ``make_big_vocab_gguf.py`` does.

    python benchmarks/tools/make_shaped_gguf.py qwen2.5-1.5b [--out PATH] [--seed 0]

Prints the path it wrote (default: the user cache dir, ``bench/``); the F16 intermediate is deleted.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_big_vocab_gguf import padded_rows  # noqa: E402  (a sibling tool)


@dataclass(frozen=True)
class Shape:
    """The hyperparameters of a published checkpoint (its config.json), as llama.cpp's qwen2 reads them."""

    name: str
    layers: int
    embd: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 151_936
    context: int = 32_768
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads


SHAPES = {
    "qwen2.5-0.5b": Shape("Qwen2.5-0.5B-Instruct", layers=24, embd=896, ffn=4864, heads=14, kv_heads=2),
    "qwen2.5-1.5b": Shape("Qwen2.5-1.5B-Instruct", layers=28, embd=1536, ffn=8960, heads=12, kv_heads=2),
}


def default_out(key: str) -> Path:
    from localctx.kvcache.hardware_profile import cache_dir

    return cache_dir() / "bench" / f"random-{key}-shape.Q4_K_M.gguf"


def tensors(shape: Shape, seed: int):
    """(name, array) pairs in llama.cpp's qwen2 naming; arrays are [out, in] as in the checkpoint."""
    rng = np.random.default_rng(seed)

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def b(n: int) -> np.ndarray:
        return (rng.standard_normal(n, dtype=np.float32) * 0.02)

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    kv = shape.kv_heads * shape.head_dim
    yield "token_embd.weight", w(shape.vocab, shape.embd)
    yield "output_norm.weight", ones(shape.embd)
    for i in range(shape.layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", ones(shape.embd)
        yield p + "attn_q.weight", w(shape.embd, shape.embd)
        yield p + "attn_q.bias", b(shape.embd)
        yield p + "attn_k.weight", w(kv, shape.embd)
        yield p + "attn_k.bias", b(kv)
        yield p + "attn_v.weight", w(kv, shape.embd)
        yield p + "attn_v.bias", b(kv)
        yield p + "attn_output.weight", w(shape.embd, shape.embd)
        yield p + "ffn_norm.weight", ones(shape.embd)
        yield p + "ffn_gate.weight", w(shape.ffn, shape.embd)
        yield p + "ffn_up.weight", w(shape.ffn, shape.embd)
        yield p + "ffn_down.weight", w(shape.embd, shape.ffn)


def write_f16(shape: Shape, tokenizer_src: Path, out: Path, seed: int) -> None:
    import gguf

    reader = gguf.GGUFReader(str(tokenizer_src))
    n_old = len(reader.fields["tokenizer.ggml.tokens"].contents())
    n_new = shape.vocab - n_old
    padding = {"tokenizer.ggml.tokens": [f"<|extra_{i}|>" for i in range(n_new)],
               "tokenizer.ggml.scores": [0.0] * n_new,
               "tokenizer.ggml.token_type": [int(gguf.TokenType.USER_DEFINED)] * n_new}
    writer = gguf.GGUFWriter(str(out), "qwen2")
    writer.add_name(f"random weights, shape of {shape.name}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.embd)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value + padding.get(key, []), vtype,
                                 sub_type=gguf.GGUFValueType(field.types[-1]))
        else:
            writer.add_key_value(key, value, vtype)
    for name, data in tensors(shape, seed):
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(src: Path, out: Path) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {src} to Q4_K_M")


def make(shape: Shape, out: Path, seed: int = 0) -> Path:
    """Write ``shape`` with random weights, quantized to Q4_K_M, at ``out`` (moved into place whole)."""
    from localctx.backends.models.ref import bundled_default_path

    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(f".{out.name}.f16.tmp")
    q = out.with_name(f".{out.name}.q4km.tmp")
    try:
        write_f16(shape, bundled_default_path(), f16, seed)
        quantize(f16, q)
        os.replace(q, out)
    finally:
        for tmp in (f16, q):
            tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    t0 = time.perf_counter()
    out = make(shape, args.out or default_out(args.shape), args.seed)
    print(f"{out} ({shape.name} shape, random weights, Q4_K_M, {out.stat().st_size / 2**20:,.0f} MiB, "
          f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
