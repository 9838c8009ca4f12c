"""Decode attention on an NVIDIA GPU against context length: fp16 K/V through torch SDPA (the
baseline), fp16 through the paged Triton kernel, and int8 / int4 group-quantized K/V (plus the
full-precision residual) through the Triton split-K kernel that the policy cache calls.

One layer, one sequence, one new token (the decode step), Llama-3-8B attention shape by default
(32 query heads, 8 KV heads, head dim 128). For each context it reports the median time of a
CUDA-graph replay of one call (launch overhead excluded; ``eager`` is the same call from
Python), the bytes the call must read (K/V payload + group scales/mins + residual) and the
achieved bandwidth against the device's peak (vendor figure from assets/hardware.json, or
--peak-gbs) and against a measured device-to-device copy.

    python benchmarks/cuda_check/attention_bench.py                 # 4K..128K, prints a table
    python benchmarks/cuda_check/attention_bench.py --json out.json

Runs in well under 5 minutes on an RTX 4090-class GPU. Without CUDA + Triton it says so and
exits 2: it never prints a number it did not measure."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class Row:
    context: int
    variant: str  # fp16-sdpa | fp16-triton | int8 | int4
    graph_us: float  # NaN when capture failed (then GB/s comes from the eager time)
    eager_us: float
    bytes_read: int
    gbs: float
    peak_fraction: float | None
    copy_fraction: float

    @property
    def best_us(self) -> float:
        return self.graph_us if self.graph_us == self.graph_us else self.eager_us


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="4096,8192,16384,32768,65536,131072",
                   help="comma-separated context lengths (default 4K..128K)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=32, choices=(32, 64))
    p.add_argument("--residual", type=int, default=128, help="most recent tokens kept in fp16")
    p.add_argument("--reps", type=int, default=100, help="timed calls per measurement")
    p.add_argument("--peak-gbs", type=float, default=None, help="device peak bandwidth (GB/s), if not in assets")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return p.parse_args(argv)


def vendor_peak_gbs(device_name: str) -> float | None:
    """The longest known GPU name contained in the device's name (assets/hardware.json)."""
    try:
        from importlib.resources import files

        data = json.loads(files("localctx.assets").joinpath("hardware.json").read_text())
        gpus = data["nvidia"]["gpus"]
    except (FileNotFoundError, KeyError, ModuleNotFoundError, json.JSONDecodeError):
        return None
    names = [n for n in gpus if n.lower() in device_name.lower()]
    return float(gpus[max(names, key=len)]["bandwidth_gbs"]) if names else None


def time_us(fn, reps: int) -> tuple[float, float]:
    """(median µs of a CUDA-graph replay, median µs of an eager call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    eager = _median_us(fn, reps)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:  # report eager time only, and say why
        print(f"warning: CUDA graph capture failed ({exc}); timing eager calls", file=sys.stderr)
        return float("nan"), eager
    return _median_us(graph.replay, reps), eager


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def copy_gbs(reps: int = 20) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes), 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _median_us(lambda: dst.copy_(src), reps)
    return 2 * src.numel() / (us * 1e-6) / 1e9


@dataclass
class Case:
    """One context's inputs, built once and shared by every variant."""
    q: torch.Tensor  # [1, Hq, 1, D] rotated (SDPA layout)
    q_raw: torch.Tensor  # [1, Hq, D] before RoPE (policy-cache layout)
    q_pos: torch.Tensor
    k: torch.Tensor  # [1, Hkv, L, D] rotated keys for the fp16 variants, pre-RoPE ones for the quantized
    v: torch.Tensor


def build_case(L: int, args, rope, device: str, dtype: torch.dtype) -> Case:
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    q_raw = torch.randn(1, H, D, device=device, dtype=dtype)
    q_pos = torch.tensor([L - 1], device=device)
    q = rope.rotate(q_raw[None], q_pos[None])[0].transpose(0, 1)[None].contiguous()
    k = torch.randn(1, Hkv, L, D, device=device, dtype=dtype)
    v = torch.randn(1, Hkv, L, D, device=device, dtype=dtype)
    return Case(q, q_raw, q_pos, k, v)


def quantized_inputs(case: Case, bits: int, args):
    """The policy cache's layout: G whole groups quantized, the newest tokens in full precision."""
    from localctx.kernels_cuda.quant_append import quantize_groups
    from localctx.kvcache.quant_attention import FullTokens, QuantGroups

    _, Hkv, L, D = case.k.shape
    g = args.group
    G = max(0, L - args.residual) // g
    n_q = G * g
    k_groups = case.k[0, :, :n_q].reshape(Hkv, G, g, D).transpose(0, 1).contiguous()
    v_groups = case.v[0, :, :n_q].reshape(Hkv, G, g, D).transpose(0, 1).contiguous()
    qk, qv = quantize_groups(k_groups, v_groups, bits, g)
    pos = torch.arange(L, device=case.k.device)
    full = FullTokens(case.k[0, :, n_q:], case.v[0, :, n_q:], pos[n_q:])
    groups = QuantGroups(qk, qv, pos[:n_q].reshape(G, g), g)
    read = qk.nbytes + qv.nbytes + full.k.nbytes + full.v.nbytes
    return full, groups, read


@dataclass
class Variant:
    name: str
    call: object  # () -> the attention output
    bytes_read: int
    check: object  # () -> max abs error against the reference


def variants(case: Case, args, rope) -> list[Variant]:
    from localctx.kernels_cuda.paged_attention import paged_attention
    from localctx.kernels_cuda.quant_attention import attend, reference
    from localctx.kvcache.quant_attention import FullTokens

    _, Hkv, L, D = case.k.shape
    sdpa = lambda: F.scaled_dot_product_attention(case.q, case.k, case.v, enable_gqa=True)
    bs = 16
    kb = case.k[0].transpose(0, 1).reshape(L // bs, bs, Hkv, D).contiguous()
    vb = case.v[0].transpose(0, 1).reshape(L // bs, bs, Hkv, D).contiguous()
    table = torch.arange(L // bs, device=kb.device)[None]
    qb = case.q.transpose(1, 2)  # [1, 1, Hq, D]
    paged = lambda: paged_attention(qb, kb, vb, table, case.q_pos[None])
    kv_bytes = case.k.nbytes + case.v.nbytes
    out = [Variant("fp16-sdpa", sdpa, kv_bytes, lambda: 0.0),
           Variant("fp16-triton", paged, kv_bytes,
                   lambda: (paged().float() - sdpa().transpose(1, 2).float()).abs().max().item())]
    for bits in (8, 4):
        full, groups, read = quantized_inputs(case, bits, args)
        call = lambda full=full, groups=groups: attend(case.q_raw, case.q_pos, full, groups, rope)
        as_float = FullTokens(full.k.float(), full.v.float(), full.positions)
        want = lambda as_float=as_float, groups=groups: reference(case.q_raw.float(), case.q_pos, as_float, groups,
                                                                  rope).out
        err = lambda call=call, want=want, groups=groups, bits=bits: max(
            (call().out.float() - want()).abs().max().item(), _quantizer_mismatch(case, groups, bits, args))
        out.append(Variant(f"int{bits}", call, read, err))
    return out


def _quantizer_mismatch(case: Case, groups, bits: int, args) -> float:
    """0 when the quantise kernel's first groups equal kvcache.quant's, bit for bit; inf otherwise."""
    from localctx.kernels_cuda.dispatch import quantize_groups_reference

    n = min(4, groups.n_groups)
    _, Hkv, _, D = case.k.shape
    g = args.group
    k = case.k[0, :, :n * g].reshape(Hkv, n, g, D).transpose(0, 1)
    v = case.v[0, :, :n * g].reshape(Hkv, n, g, D).transpose(0, 1)
    rk, rv = quantize_groups_reference(k, v, bits, g)
    same = all(torch.equal(a[:n], b) for a, b in ((groups.k.codes, rk.codes), (groups.k.scale, rk.scale),
                                                  (groups.k.min, rk.min), (groups.v.codes, rv.codes),
                                                  (groups.v.scale, rv.scale), (groups.v.min, rv.min)))
    return 0.0 if same else float("inf")


def measure(L: int, args, rope, peak: float | None, copy: float, check: bool) -> list[Row]:
    case = build_case(L, args, rope, "cuda", torch.float16)
    rows = []
    for var in variants(case, args, rope):
        if check:
            err = var.check()
            if not err < 2e-2:
                print(f"error: {var.name} differs from its reference by {err:.3g} at {L} tokens; not timing a "
                      "wrong kernel", file=sys.stderr)
                raise SystemExit(1)
        graph_us, eager_us = time_us(var.call, args.reps)
        row = Row(L, var.name, graph_us, eager_us, var.bytes_read, 0.0, None, 0.0)
        row.gbs = var.bytes_read / (row.best_us * 1e-6) / 1e9
        row.peak_fraction = row.gbs / peak if peak else None
        row.copy_fraction = row.gbs / copy
        rows.append(row)
    return rows


def print_table(rows: list[Row], device: str, peak: float | None, copy: float) -> None:
    print(f"device: {device}; peak {peak or 'unknown'} GB/s (vendor); measured copy {copy:.0f} GB/s")
    print(f"{'context':>8} {'variant':>12} {'graph µs':>9} {'eager µs':>9} {'MiB read':>9} {'GB/s':>7} "
          f"{'% peak':>7} {'vs fp16-sdpa':>12}")
    base = {r.context: r.best_us for r in rows if r.variant == "fp16-sdpa"}
    for r in rows:
        pct = f"{100 * r.peak_fraction:6.1f}%" if r.peak_fraction is not None else "      -"
        print(f"{r.context:>8} {r.variant:>12} {r.graph_us:>9.1f} {r.eager_us:>9.1f} {r.bytes_read / 2**20:>9.1f} "
              f"{r.gbs:>7.0f} {pct:>7} {base[r.context] / r.best_us:>11.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs an NVIDIA GPU (torch.cuda.is_available() is False); nothing was measured",
              file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("this benchmark needs Triton (pip install 'localctx[cuda]'); nothing was measured", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it to time compiled kernels; nothing was measured", file=sys.stderr)
        return 2
    from localctx.backends.torch.rope import Rope

    contexts = [int(c) for c in args.contexts.split(",")]
    if any(c % 16 or c <= args.residual for c in contexts):
        print("error: every context must be a multiple of 16 and longer than --residual", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    peak = args.peak_gbs or vendor_peak_gbs(device)
    copy = copy_gbs()
    rope = Rope(args.head_dim, 500000.0, device="cuda", initial=max(contexts))
    rows = []
    for i, L in enumerate(contexts):
        rows += measure(L, args, rope, peak, copy, check=i == 0)
        torch.cuda.empty_cache()
    print_table(rows, device, peak, copy)
    if args.json:
        args.json.write_text(json.dumps({"device": device, "peak_gbs": peak, "copy_gbs": copy,
                                         "shape": {"heads": args.heads, "kv_heads": args.kv_heads,
                                                   "head_dim": args.head_dim, "group": args.group,
                                                   "residual": args.residual},
                                         "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
