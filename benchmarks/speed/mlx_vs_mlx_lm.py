"""`localctx run --backend mlx` decode against mlx-lm's own generation loop on the same model, paired
and interleaved run by run (both see the same machine load):

    python benchmarks/speed/mlx_vs_mlx_lm.py [-m GGUF] [--prompt-tokens 128] [--decode 64] [--reps 3]

The model is the GGUF converted for mlx-lm (backends/mlx/gguf_convert.py; default: the bundled
SmolLM2-135M re-quantized to Q4_K_M with llama.cpp's quantizer into a temporary folder). localctx's
side is the session `localctx run` drives (graph mlx-lm, KV policies fp16 / int8 / int4, every answer
max tokens long); its decode tok/s is the figure `run --json` reports, its KV bytes both what it holds
(``kvcache.cost.kv_bytes``) and what its buffers allocate (with the spare rows: backends/mlx/full_rows.py). Both sides run the same model
object's weights as the backend loads them (off Metal: quantized layers expanded to float32,
``LoadOptions.dequantize``). mlx-lm's side is
``mlx_lm.generate.generate_step`` (the loop inside ``mlx_lm.generate``) with the same KV settings:
its KVCache, or ``kv_bits`` 8/4 with group 64 from the first token. Both sides call the BLAS `localctx run`
gives MLX (backends/mlx/blas.py: on Linux a system OpenBLAS where one is installed; ``blas`` in the JSON).
Prints one JSON object."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from localctx.backends.mlx.blas import use_system_openblas  # noqa: I001  (before mlx.core)
import mlx.core as mx

from localctx.backends.base import GenerationParams
from localctx.backends.mlx import zoo
from localctx.backends.mlx.backend import MLXBackend
from localctx.backends.mlx.gguf_convert import converted_folder
from localctx.backends.mlx.session import SessionOptions
from localctx.backends.models.ref import ModelRef, resolve
from localctx.backends.models.spec_reader import read_spec
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy

SETTINGS = {"fp16": None, "int8": 8, "int4": 4}  # localctx policy → mlx-lm kv_bits


def requantized_smollm2(folder: Path) -> Path:
    import llama_cpp

    out = folder / "smollm2-q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(resolve(None).path).encode(), str(out).encode(), ctypes.byref(params)):
        raise SystemExit("llama.cpp could not re-quantize the bundled SmolLM2")
    return out


def prompt_text(session, n: int) -> str:
    from pydoc_data.topics import topics

    ids = session.tokenizer.encode(" ".join(topics[k] for k in sorted(topics)))[:n]
    return b"".join(session.tokenizer.token_bytes(t) for t in ids).decode("utf-8", "replace")


def localctx_run(session, prompt: str, n: int) -> float:
    session.reset()
    events = list(session.generate(prompt, GenerationParams(max_tokens=n, ignore_eos=True, speculate="off")))
    return events[-1].stats.decode_tok_s


def mlx_lm_run(model, ids: list[int], n: int, kv_bits: int | None) -> float:
    from mlx_lm.generate import generate_step

    extra = {"kv_bits": kv_bits, "kv_group_size": 64, "quantized_kv_start": 0} if kv_bits else {}
    stamps = []
    for _tok, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1), **extra):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])  # as run's figure: the steps after the first token


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/speed/mlx_vs_mlx_lm.py")
    ap.add_argument("-m", "--model", type=Path, help="a GGUF (default: SmolLM2-135M re-quantized to Q4_K_M)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or requantized_smollm2(Path(tmp))
        folder = converted_folder(path)
        ref = ModelRef("gguf", path, path.name, "file")
        spec = read_spec(ref)
        anchor = zoo.load_folder(folder, spec.architecture).model  # as the backend loads it (expanded off Metal)
        backend = MLXBackend(SessionOptions(graph="mlx-lm"))
        sessions = {kv: backend.load(ref, Plan.fixed("mlx", spec, KVPolicy.parse(kv), 4096)) for kv in SETTINGS}
        prompt = prompt_text(sessions["fp16"], args.prompt_tokens)
        ids = sessions["fp16"].tokenizer.encode(prompt)
        load_before = os.getloadavg()
        runs = {kv: {"localctx": [], "mlx_lm": []} for kv in SETTINGS}
        load_during = []
        for rep in range(args.reps):
            for kv, bits in SETTINGS.items():
                pair = [("localctx", lambda: localctx_run(sessions[kv], prompt, args.decode)),
                        ("mlx_lm", lambda: mlx_lm_run(anchor, ids, args.decode, bits))]
                for side, run in (pair if rep % 2 == 0 else pair[::-1]):
                    runs[kv][side].append(run())
                    print(f"rep {rep} {kv} {side}: {runs[kv][side][-1]:.2f} decode tok/s", file=sys.stderr, flush=True)
            load_during.append(os.getloadavg()[0])
        given = sys.argv[1:] if argv is None else argv
        out = {"command": " ".join(["python benchmarks/speed/mlx_vs_mlx_lm.py", *given]),
               "model": path.name, "converted": str(folder.name), "prompt_tokens": len(ids), "decode_tokens": args.decode,
               "reps": args.reps, "host": platform.platform(), "cpu_count": os.cpu_count(),
               "metal": mx.metal.is_available(), "mlx": mx.__version__,
               "blas": use_system_openblas().library or "bundled", "loadavg_before": load_before,
               "loadavg_after": os.getloadavg(), "loadavg_1min_after_each_rep": load_during, "results": {}}
        import mlx_lm

        out["mlx_lm"] = mlx_lm.__version__
        for kv, r in runs.items():
            ours, theirs = statistics.median(r["localctx"]), statistics.median(r["mlx_lm"])
            out["results"][kv] = {"localctx_decode_tok_s": round(ours, 2), "mlx_lm_decode_tok_s": round(theirs, 2),
                                  "ratio": round(ours / theirs, 3), "runs": r,
                                  "kv_bytes": sessions[kv].cache.nbytes(),  # held: cost.kv_bytes
                                  "kv_bytes_allocated": sessions[kv].cache.allocated_bytes()}  # with spare rows
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
