"""What one decode step's attention should cost on an RTX 4090, from bytes alone (compiled, not run):
for the Llama-3-8B and Qwen2.5-7B shapes at 8K/32K/128K tokens, the bytes the kernels move per
step (``kvcache.decode_traffic``: codes, scales, full-precision tokens, queries, outputs, the one
function the planner's speed model also uses, plus the split-K partials the launcher's split
count implies) and the time at the 4090's 1,008 GB/s, against fp16 SDPA's bytes for the same tokens.

    python benchmarks/cuda_check/projection.py --json docs/results/cuda/decode-projection.json

No GPU ran anything: these are upper bounds at the vendor's peak bandwidth (a kernel reaches some
fraction of it, and which fraction is what ``one_run.py`` measures)."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from localctx.kernels_cuda import launch, occupancy
from localctx.kvcache import decode_traffic, known_models
from localctx.kvcache.policy import KVPolicy

MODELS = ("llama-3-8b", "qwen2.5-7b")
CONTEXTS = (8192, 32768, 131072)
POLICIES = ("fp16", "int8+res128", "int4+res128")  # the paged kernel; the policy kernel with a 128-token fp16 residual
PEAK_GBS = 1008.0  # RTX 4090: 21 Gbps GDDR6X on a 384-bit bus
DTYPE = "fp16"


def partial_bytes(spec, policy: KVPolicy, n_tokens: int) -> tuple[int, int, int]:
    """(bytes, split count, key tile) of the split-K partials one step writes and the merge reads,
    over all layers: per KV head, splits × query rows × (D outputs + max + sum) fp32, twice."""
    view = launch.DeviceView(launch.DESIGN_ARCH, occupancy.ARCHS[launch.DESIGN_ARCH].sms)
    rep = spec.n_heads // spec.n_kv_heads
    rows = rep  # one new token
    g = policy.group_size if policy.quantized else None
    # the policy cache's kernel rotates keys in registers; the paged cache (fp16) stores them rotated
    segment = launch.segment_name(policy.k_bits if policy.quantized else None, g, policy.quantized)
    held = decode_traffic.cost.split_tokens(policy, n_tokens)
    groups = held[0] // policy.group_size if policy.quantized else 0
    programs = spec.n_kv_heads * math.ceil(rows / launch.BLOCK_M)
    chosen = launch.choose_launch(view, spec.head_dim, DTYPE, segment, lambda bn: groups + math.ceil(held[1] / bn),
                                  programs, group=g or 0)
    per_layer = 2 * spec.n_kv_heads * chosen.splits * rows * (spec.head_dim + 2) * 4
    return spec.n_layers * per_layer, chosen.splits, chosen.block_n


def rows() -> list[dict]:
    out = []
    for name in MODELS:
        spec = known_models.known_spec(name)
        for ctx in CONTEXTS:
            sdpa = decode_traffic.step_traffic(spec, KVPolicy.parse("fp16"), ctx)
            for text in POLICIES:
                policy = KVPolicy.parse(text)
                t = decode_traffic.step_traffic(spec, policy, ctx)
                partials, splits, block_n = partial_bytes(spec, policy, ctx)
                kernel = t.total + partials
                out.append({"model": name, "context": ctx, "policy": text, "codes": t.codes, "scales": t.scales,
                            "full_tokens": t.full_tokens, "queries": t.queries, "outputs": t.outputs,
                            "split_partials": partials, "splits": splits, "block_n": block_n,
                            "kernel_bytes": kernel, "sdpa_bytes": sdpa.sdpa_total,
                            "kernel_ms_at_peak": kernel / (PEAK_GBS * 1e9) * 1e3,
                            "sdpa_ms_at_peak": sdpa.sdpa_total / (PEAK_GBS * 1e9) * 1e3,
                            "kernel_over_sdpa": kernel / sdpa.sdpa_total,
                            "weights_bytes": spec.decode_weight_bytes})
    return out


def markdown(rows: list[dict]) -> str:
    mib = lambda b: f"{b / 2**20:,.1f}"
    out = ["| model | context | KV policy | codes MiB | scales MiB | fp tokens MiB | q + out MiB | partials MiB "
           "(splits) | kernel MiB | kernel ms at peak | fp16 SDPA MiB | SDPA ms at peak | kernel ÷ SDPA |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['context'] // 1024}K | `{r['policy']}` | {mib(r['codes'])} | {mib(r['scales'])} | "
                   f"{mib(r['full_tokens'])} | {mib(r['queries'] + r['outputs'])} | {mib(r['split_partials'])} "
                   f"({r['splits']}) | {mib(r['kernel_bytes'])} | {r['kernel_ms_at_peak']:.3f} | {mib(r['sdpa_bytes'])} | "
                   f"{r['sdpa_ms_at_peak']:.3f} | {r['kernel_over_sdpa']:.3f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--markdown", action="store_true", help="print the docs table instead of the plain listing")
    args = p.parse_args(argv)
    data = {"command": "python benchmarks/cuda_check/projection.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "note": "compiled, not run: bytes divided by the RTX 4090's peak bandwidth; no GPU timed anything",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "peak_gbs": PEAK_GBS, "dtype": DTYPE,
            "device_view": {"arch": launch.DESIGN_ARCH, "sms": occupancy.ARCHS[launch.DESIGN_ARCH].sms},
            "rows": rows()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    if args.markdown:
        print(markdown(data["rows"]))
        return 0
    for r in data["rows"]:
        print(f"{r['model']:11} {r['context']:>7} {r['policy']:12} kernel {r['kernel_bytes'] / 2**20:9.1f} MiB "
              f"{r['kernel_ms_at_peak']:7.3f} ms  sdpa {r['sdpa_bytes'] / 2**20:9.1f} MiB {r['sdpa_ms_at_peak']:7.3f} ms"
              f"  ×{r['kernel_over_sdpa']:.3f}  splits {r['splits']} bn {r['block_n']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
