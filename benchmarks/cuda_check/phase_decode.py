"""Phase 2 of benchmarks/cuda_check/one_run.py: one decode step of attention (one layer, one new token per
sequence) at each context and batch — fp16 K/V through torch's scaled_dot_product_attention (the
backend torch picks, and each backend forced), fp16 through the paged Triton kernel, and int8 /
int4 groups plus a full-precision residual through the split-K kernel the policy cache calls.

Times are medians of CUDA-event-timed calls after a warm-up (eager: what the backend pays, launch
gaps included) and of CUDA-graph replays (launch overhead excluded). Bytes read are the K/V the
call must read (codes + group scales/mins + residual for the quantized ones)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import DecodeSizes, PhaseClock, graph_median_ms, median_ms
from localctx.backends.torch.rope import Rope
from localctx.kernels_cuda.launch import FullSegment, QuantSegment, Queries, run_attention
from localctx.kernels_cuda.paged_attention import paged_attention
from localctx.kernels_cuda.quant_append import quantize_groups
from localctx.kvcache.quant import QuantizedTensor
from localctx.kvcache.quant_attention import FullTokens, QuantGroups, attend_reference

SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


@dataclass
class Inputs:
    q_raw: torch.Tensor  # [B, Hq, D] before RoPE
    q_pos: torch.Tensor  # [B, 1]
    q: torch.Tensor  # [B, 1, Hq, D] rotated
    k: torch.Tensor  # [B, Hkv, L, D]
    v: torch.Tensor


@dataclass
class Variant:
    name: str
    call: object  # () -> output [B, 1, Hq, D], or [B, Hq, 1, D] with heads_first (SDPA's layout)
    bytes_read: int
    note: str = ""
    heads_first: bool = False
    optional: bool = False  # a forced SDPA backend: inputs it does not take are "unavailable", not an error


def build_inputs(B: int, L: int, s: DecodeSizes, rope: Rope, device: torch.device) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(L + B)
    q_raw = torch.randn(B, s.heads, s.head_dim, generator=gen, device=device, dtype=s.dtype)
    q_pos = torch.full((B, 1), L - 1, device=device)
    q = rope.rotate(q_raw[:, None], q_pos)
    k = torch.randn(B, s.kv_heads, L, s.head_dim, generator=gen, device=device, dtype=s.dtype)
    v = torch.randn(B, s.kv_heads, L, s.head_dim, generator=gen, device=device, dtype=s.dtype)
    return Inputs(q_raw, q_pos, q, k, v)


def sdpa_choice(x: Inputs) -> str:
    """The backend torch's dispatcher picks for these SDPA inputs (torch._fused_sdp_choice)."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(x.q.transpose(1, 2), x.k, x.v, enable_gqa=True)
        return SDPBackend(choice).name
    except Exception as exc:  # a private helper: say why it could not answer
        return f"unknown ({type(exc).__name__}: {str(exc)[:120]})"


def sdpa_variants(x: Inputs) -> list[Variant]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = x.q.transpose(1, 2).contiguous()
    kv_bytes = x.k.nbytes + x.v.nbytes
    out = [Variant("sdpa", lambda: F.scaled_dot_product_attention(q, x.k, x.v, enable_gqa=True), kv_bytes,
                   f"torch picks {sdpa_choice(x)}", heads_first=True)]
    for name in SDPA_BACKENDS:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def forced(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, x.k, x.v, enable_gqa=True)
        out.append(Variant(f"sdpa-{name.split('_')[0].lower()}", forced, kv_bytes, f"forced {name}",
                           heads_first=True, optional=True))
    return out


def paged_variant(x: Inputs, bs: int = 16) -> Variant:
    B, Hkv, L, D = x.k.shape
    kb = x.k.transpose(1, 2).reshape(B * L // bs, bs, Hkv, D).contiguous()
    vb = x.v.transpose(1, 2).reshape(B * L // bs, bs, Hkv, D).contiguous()
    tables = torch.arange(B * L // bs, device=kb.device).reshape(B, L // bs)
    return Variant("fp16-triton-paged", lambda: paged_attention(x.q, kb, vb, tables, x.q_pos), kb.nbytes + vb.nbytes)


@dataclass
class QuantInputs:
    full: FullSegment
    quant: QuantSegment
    groups_per_seq: int
    bytes_read: int


def quant_inputs(x: Inputs, bits: int, s: DecodeSizes) -> QuantInputs:
    """The policy cache's layout for B sequences: G whole groups quantized by the kernel (group
    table: sequence b owns pool groups b·G … b·G+G−1), the newest tokens in full precision."""
    B, Hkv, L, D = x.k.shape
    g = s.group
    G = (L - s.residual) // g
    n_q, N = G * g, L - G * g
    dev = x.k.device
    grouped = lambda t: t[:, :, :n_q].reshape(B, Hkv, G, g, D).transpose(1, 2).reshape(B * G, Hkv, g, D)
    qk, qv = quantize_groups(grouped(x.k), grouped(x.v), bits, g)
    quant = QuantSegment(qk.codes, qk.scale, qk.min, qv.codes, qv.scale, qv.min,
                         group_table=torch.arange(B * G, dtype=torch.int32, device=dev).reshape(B, G),
                         positions=torch.arange(n_q, device=dev).reshape(1, G, g).expand(B, G, g).contiguous(),
                         n_groups=torch.full((B,), G, dtype=torch.int32, device=dev), bits=bits, group_size=g)
    fk = x.k[:, :, n_q:].transpose(1, 2).contiguous()  # [B blocks of N tokens, N, Hkv, D]
    fv = x.v[:, :, n_q:].transpose(1, 2).contiguous()
    full = FullSegment(k=fk, v=fv, k_strides=tuple(fk.stride()[:3]), v_strides=tuple(fv.stride()[:3]),
                       block_table=torch.arange(B, dtype=torch.int32, device=dev).reshape(B, 1), block_size=N,
                       positions=(n_q + torch.arange(N, device=dev)).reshape(1, N),
                       n_tokens=torch.full((B,), N, dtype=torch.int32, device=dev), max_tokens=N, n_kv_heads=Hkv)
    read = sum(t.nbytes for t in (qk.codes, qk.scale, qk.min, qv.codes, qv.scale, qv.min, fk, fv))
    return QuantInputs(full, quant, G, read)


def quant_error(x: Inputs, qi: QuantInputs, out: torch.Tensor, rope: Rope, b: int, s: DecodeSizes) -> float:
    """Sequence b of the batched kernel call against attend_reference on the same codes (fp32)."""
    G, g, q = qi.groups_per_seq, s.group, qi.quant
    part = lambda t: t[b * G:(b + 1) * G]
    codes = lambda c, sc, mn: QuantizedTensor(part(c), part(sc), part(mn), q.bits)
    groups = QuantGroups(codes(q.k_codes, q.k_scale, q.k_min), codes(q.v_codes, q.v_scale, q.v_min),
                         q.positions[b], g)
    f = qi.full
    full = FullTokens(f.k[b].transpose(0, 1).float(), f.v[b].transpose(0, 1).float(), f.positions[0])
    want = attend_reference(x.q_raw[b:b + 1].float(), x.q_pos[b], full, groups, rope).out
    return float((out[b].float() - want).abs().max())


def run(s: DecodeSizes, clock: PhaseClock, copy_gbs: float, device: torch.device) -> dict:
    rope = Rope(s.head_dim, 500000.0, device=str(device), initial=max(s.contexts) + 1)
    rows, skipped, errors, unavailable, checks = [], [], [], [], []
    for i, L in enumerate(s.contexts):
        for B in s.batches:
            if not clock.allows(15.0 if device.type == "cuda" else 1.0):
                skipped.append({"context": L, "batch": B, "reason": "time budget"})
                continue
            t0 = time.monotonic()
            try:
                with torch.inference_mode():
                    case = measure(L, B, s, rope, copy_gbs, device, checks if i == 0 else None, errors, unavailable)
                rows += [{**r, "case_seconds": time.monotonic() - t0} for r in case]
            except Exception as exc:
                errors.append({"context": L, "batch": B, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    bad = [c for c in checks if not c["passed"]]
    status = "ok" if rows and not errors and not bad else "failed"
    if not rows and not errors and skipped:
        status = "skipped"  # no time was left for any case
    return {"status": status, "shape": {"heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
                                        "group": s.group, "residual": s.residual,
                                        "dtype": str(s.dtype).replace("torch.", "")},
            "reps": s.reps, "warmup": s.warmup, "copy_gbs": copy_gbs, "rows": rows, "checks": checks,
            "errors": errors, "unavailable": unavailable, "skipped": skipped, "goal": int4_goal(rows)}


def measure(L: int, B: int, s: DecodeSizes, rope: Rope, copy_gbs: float, device: torch.device,
            checks: list | None, errors: list, unavailable: list) -> list[dict]:
    x = build_inputs(B, L, s, rope, device)
    variants = sdpa_variants(x) + [paged_variant(x)]
    quants = {}
    for bits in (8, 4):
        qi = quants[bits] = quant_inputs(x, bits, s)
        call = lambda qi=qi: run_attention(Queries(x.q, x.q_pos), qi.full, qi.quant, inv_freq=rope.inv_freq,
                                           scale=s.head_dim ** -0.5)[0]
        variants.append(Variant(f"int{bits}", call, qi.bytes_read, f"{qi.groups_per_seq} groups + "
                                f"{qi.full.max_tokens} fp16 tokens per sequence; one batched launch"))
    base = None
    out = []
    for var in variants:
        try:
            if checks is not None:
                checks.append(check(var, x, quants, rope, s, L, B))
            eager = median_ms(var.call, s.reps, s.warmup, device)
            graph, why = graph_median_ms(var.call, s.reps, device)
        except Exception as exc:
            (unavailable if var.optional else errors).append(
                {"context": L, "batch": B, "variant": var.name,
                 "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"})
            continue
        best = graph if graph is not None else eager
        base = best if var.name == "sdpa" else base
        gbs = var.bytes_read / (best * 1e-3) / 1e9
        out.append({"context": L, "batch": B, "variant": var.name, "note": var.note, "eager_ms": eager,
                    "graph_ms": graph, "graph_note": why, "bytes_read": var.bytes_read, "gbs": gbs,
                    "copy_fraction": gbs / copy_gbs, "speedup_vs_sdpa": (base / best) if base else None})
    return out  # the inputs are freed with this frame


def check(var: Variant, x: Inputs, quants: dict, rope: Rope, s: DecodeSizes, L: int, B: int) -> dict:
    """Each variant against its reference at the first context (first and last sequence)."""
    got = var.call()
    if var.name.startswith("int"):
        qi = quants[int(var.name[3:])]
        err = max(quant_error(x, qi, got, rope, b, s) for b in {0, B - 1})
    else:
        want = attend_dense(x)
        got = got.transpose(1, 2) if var.heads_first else got
        err = float((got.float() - want).abs().max())
    tol = 1e-3 if s.dtype == torch.float32 else 2e-2
    return {"context": L, "batch": B, "variant": var.name, "max_abs_err": err, "tol": tol, "passed": err <= tol}


def attend_dense(x: Inputs) -> torch.Tensor:
    """fp32 attention of the rotated query over every key: [B, 1, Hq, D]."""
    q = x.q.float().transpose(1, 2)
    out = F.scaled_dot_product_attention(q, x.k.float(), x.v.float(), enable_gqa=True)
    return out.transpose(1, 2)


def int4_goal(rows: list[dict]) -> dict:
    """Issue 24's goal: int4 decode attention ≥ 2.5× fp16 SDPA from 32K cached tokens on."""
    pairs = [(r["context"], r["batch"], r["speedup_vs_sdpa"]) for r in rows
             if r["variant"] == "int4" and r["context"] >= 32768 and r["speedup_vs_sdpa"]]
    return {"target": 2.5, "from_context": 32768,
            "speedups": [{"context": c, "batch": b, "speedup": x} for c, b, x in pairs],
            "met": bool(pairs) and all(x >= 2.5 for _, _, x in pairs)}
