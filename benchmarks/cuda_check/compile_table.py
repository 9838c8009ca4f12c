"""The tables of docs/benchmarks-cuda.md from compile.py's JSON files (one per architecture, or a
first pass and a ``--only-failed`` retry) and the launcher's table:

    python benchmarks/cuda_check/compile_table.py docs/results/cuda/compile-sm89.json docs/results/cuda/compile-sm90.json

Only what the launcher launches counts: a partial/mass specialization whose warps are not its
table row's (a retry's variant replaced it) is counted as rejected.

1. per kernel and head dim, over every dtype, key segment and tile: specializations launched,
   registers (min–max), shared memory (max), resident programs per SM (min), spills, and how many
   were rejected, per arch;
2. the launcher's kernel (partial_kernel) per head dim, key segment, key tile and warps, fp16 and
   bf16 together (the larger of the two), with what the launcher picks for fp16 on the RTX 4090."""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from localctx.kernels_cuda import launch


def segment(c: dict) -> str:
    if "HAS_QUANT" not in c:
        return "—"
    return launch.segment_name(c["BITS"] if c["HAS_QUANT"] else None, c["GROUP"], c["ROPE"])


def launched(spec: dict, arch: str) -> bool:
    """Whether the launcher launches this specialization on ``arch`` (see the module docstring)."""
    if spec["kernel"] not in ("partial_kernel", "mass_kernel"):
        return True
    c = spec["constexprs"]
    key = launch.table_key(c["HEAD_DIM"], spec["dtype"], segment(c), c["BLOCK_N"])
    row = launch.resource_table()[arch].get(key if spec["kernel"] == "partial_kernel" else launch.MASS + key)
    return row is not None and row["warps"] == spec["results"][arch]["warps"]


def kernel_table(runs: dict) -> list[str]:
    groups = defaultdict(lambda: defaultdict(list))
    rejected = defaultdict(int)
    for arch, datas in runs.items():
        for data in datas:
            for s in data["specializations"]:
                if launched(s, arch):
                    groups[(s["kernel"], s["constexprs"]["HEAD_DIM"])][arch].append(s["results"][arch])
                else:
                    rejected[(s["kernel"], s["constexprs"]["HEAD_DIM"], arch)] += 1
    archs = list(runs)
    head = "| kernel | head dim | " + " | ".join(f"{a}: launched · registers · shared (max) · programs/SM (min) · "
                                                f"spills · rejected" for a in archs) + " |"
    out = [head, "|---|---|" + "---|" * len(archs)]
    for (kernel, D), by_arch in sorted(groups.items()):
        cells = []
        for a in archs:
            rs = [r for r in by_arch.get(a, []) if "registers" in r]
            if not rs:
                cells.append("not compiled")
                continue
            regs = sorted(r["registers"] for r in rs)
            spills = sum(r["spill_stores"] + r["spill_loads"] for r in rs)
            cells.append(f"{len(rs)} · {regs[0]}–{regs[-1]} · {max(r['shared'] for r in rs) / 1024:.1f} KiB · "
                         f"{min(r['blocks_per_sm'] for r in rs)} · {spills} B · {rejected[(kernel, D, a)]}")
        out.append(f"| `{kernel}` | {D} | " + " | ".join(cells) + " |")
    return out


def partial_table(runs: dict) -> list[str]:
    rows = defaultdict(lambda: defaultdict(list))  # (D, segment, BLOCK_N, warps) → arch → results
    for arch, datas in runs.items():
        for s in (s for data in datas for s in data["specializations"]):
            if s["kernel"] != "partial_kernel" or not launched(s, arch):
                continue
            c = s["constexprs"]
            rows[(c["HEAD_DIM"], segment(c), c["BLOCK_N"], s["options"].get("num_warps", 4))][arch].append(
                s["results"][arch])
    archs = list(runs)
    out = ["| head dim | key segment | BLOCK_N | warps | " + " | ".join(
        f"{a}: registers · shared · programs/SM · occupancy · limiter · spills" for a in archs) + " | 4090 picks |",
           "|---|---|---|---|" + "---|" * len(archs) + "---|"]
    view = launch.DeviceView("sm_89", 128)
    for (D, seg, bn, warps), by_arch in sorted(rows.items()):
        cells = []
        for a in archs:
            rs = by_arch.get(a, [])
            if not rs:
                cells.append("not compiled")
                continue
            r = max(rs, key=lambda r: (r["registers"], r["shared"]))
            spilled = r["spill_stores"] + r["spill_loads"]
            cells.append(f"{r['registers']} · {r['shared'] / 1024:.1f} KiB · {r['blocks_per_sm']} · "
                         f"{r['occupancy']:.0%} · {r['limiter']} · {spilled} B")
        chosen = launch.choose_launch(view, D, "fp16", seg, lambda b: 1024, 8)
        picked = (chosen.block_n, chosen.warps) == (bn, warps)
        out.append(f"| {D} | {seg} | {bn} | {warps} | " + " | ".join(cells) + f" | {'yes' if picked else ''} |")
    return out


def main(argv=None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    runs = defaultdict(list)
    for p in paths:
        data = json.loads(p.read_text())
        for arch in data["archs"]:
            runs[arch].append(data)
    print("\n".join(kernel_table(runs)))
    print()
    print("\n".join(partial_table(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
