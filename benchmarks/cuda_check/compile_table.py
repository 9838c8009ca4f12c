"""The tables of docs/benchmarks-cuda.md from compile.py's JSON files (one per architecture):

    python benchmarks/cuda_check/compile_table.py docs/results/cuda/compile-sm89.json docs/results/cuda/compile-sm90.json

1. per kernel and head dim, over every dtype, key segment and tile: specializations compiled,
   registers (min–max), shared memory (max), resident programs per SM (min) and spills, per arch;
2. the launcher's kernel (partial_kernel) per head dim, key segment and key tile, fp16 and bf16
   together (the larger of the two), with what the launcher picks on the RTX 4090."""
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


def kernel_table(runs: dict) -> list[str]:
    groups = defaultdict(lambda: defaultdict(list))
    for arch, data in runs.items():
        for s in data["specializations"]:
            groups[(s["kernel"], s["constexprs"]["HEAD_DIM"])][arch].append(s["results"][arch])
    archs = list(runs)
    head = "| kernel | head dim | " + " | ".join(f"{a}: compiled · registers · shared (max) · programs/SM (min) · spills"
                                                for a in archs) + " |"
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
                         f"{min(r['blocks_per_sm'] for r in rs)} · {spills} B")
        out.append(f"| `{kernel}` | {D} | " + " | ".join(cells) + " |")
    return out


def partial_table(runs: dict) -> list[str]:
    rows = defaultdict(lambda: defaultdict(list))
    for arch, data in runs.items():
        for s in data["specializations"]:
            if s["kernel"] != "partial_kernel":
                continue
            c = s["constexprs"]
            rows[(c["HEAD_DIM"], segment(c), c["BLOCK_N"], s["options"].get("num_warps", 4))][arch].append(
                s["results"][arch])
    archs = list(runs)
    out = ["| head dim | key segment | BLOCK_N | warps | " + " | ".join(
        f"{a}: registers · shared · programs/SM · occupancy · limiter" for a in archs) + " | 4090 picks |",
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
            cells.append(f"{r['registers']} · {r['shared'] / 1024:.1f} KiB · {r['blocks_per_sm']} · "
                         f"{r['occupancy']:.0%} · {r['limiter']}")
        try:
            picked = launch.choose_launch(view, D, "fp16", seg, lambda b: 1024, 8).block_n == bn
        except KeyError:
            picked = False
        out.append(f"| {D} | {seg} | {bn} | {warps} | " + " | ".join(cells) + f" | {'yes' if picked else ''} |")
    return out


def main(argv=None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    runs = {}
    for p in paths:
        data = json.loads(p.read_text())
        for arch in data["archs"]:
            runs[arch] = data
    print("\n".join(kernel_table(runs)))
    print()
    print("\n".join(partial_table(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
