"""Make a 151,936-token-vocabulary GGUF (Qwen2's vocabulary size) from the bundled SmolLM2, for the
startup benchmark: every metadata value is copied with its type, the token list (and its scores and
types) is padded with extra user-defined tokens ``<|extra_N|>``, and ``token_embd`` (and ``output``,
if the file has one) gets zero rows of the same quant type, so llama.cpp loads it and answers as
SmolLM2 does (the new tokens are never produced: their logits are zero rows, and no merge makes them).

    python benchmarks/tools/make_big_vocab_gguf.py [--vocab 151936] [--out PATH]

Prints the path it wrote. The default path is in the user cache dir (``bench/``), next to nothing
the project commits: the file is ~200 MB and is rebuilt in a few seconds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

QWEN2_VOCAB = 151_936
ROW_TENSORS = ("token_embd.weight", "output.weight")  # [n_vocab rows, n_embd] tensors to pad


def default_out(vocab: int) -> Path:
    from localctx.kvcache.hardware_profile import cache_dir

    return cache_dir() / "bench" / f"SmolLM2-135M-Instruct.Q4_1.vocab{vocab}.gguf"


def padded_rows(data: np.ndarray, rows: int) -> np.ndarray:
    """``data`` (rows first; quantised tensors come as uint8 [rows, bytes per row]) with zero rows
    appended up to ``rows``. An all-zero block is a zero row in every ggml quant type."""
    extra = np.zeros((rows - data.shape[0], *data.shape[1:]), dtype=data.dtype)
    return np.concatenate([np.asarray(data), extra])


def make(src: Path, out: Path, vocab: int, token_type: int) -> Path:
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    n_old = len(tokens)
    if vocab <= n_old:
        raise SystemExit(f"--vocab {vocab} must be more than the source's {n_old} tokens")
    n_new = vocab - n_old
    padding = {"tokenizer.ggml.tokens": [f"<|extra_{i}|>" for i in range(n_new)],
               "tokenizer.ggml.scores": [0.0] * n_new,
               "tokenizer.ggml.token_type": [token_type] * n_new}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            value = value + padding.get(key, [])
            writer.add_key_value(key, value, vtype, sub_type=gguf.GGUFValueType(field.types[-1]))
        elif key == f"{arch}.vocab_size":
            writer.add_key_value(key, vocab, vtype)
        else:
            writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        data = padded_rows(t.data, vocab) if t.name in ROW_TENSORS else t.data
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    import gguf

    from localctx.backends.models.ref import bundled_default_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=QWEN2_VOCAB)
    ap.add_argument("--src", type=Path, default=None, help="source GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--token-type", choices=("user_defined", "control"), default="user_defined")
    args = ap.parse_args(argv)
    token_type = int(getattr(gguf.TokenType, args.token_type.upper()))
    out = make(args.src or bundled_default_path(), args.out or default_out(args.vocab), args.vocab, token_type)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
