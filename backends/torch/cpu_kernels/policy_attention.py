"""Decode attention over a policy cache on the CPU, in C (``policy_attention.c``), behind
``kvcache.quant_attention.attend_reference``'s signature and returning the same result.

The reference dequantizes and rotates every cached key at every step; at 8K cached tokens that
costs several times fp16 attention, which made quantized KV the slow choice on a CPU. The C
kernel decodes a group of keys at a time into a small buffer, rotates them and dots them with the
queries of their head group, takes the softmax and sums the values the same way, in float32 with
the fp16 scales, over torch's thread count, in one call per layer. On an AVX-512 CPU the
full-precision tokens (a sliding window's, the recent residual) take a path that keeps each row in
vector registers and reads ahead of itself, since at a 1,024-token window that read is most of
the step's growth over a short context.

It serves steps of up to ``MAX_QUERIES`` query tokens (decode); longer ones (prefill chunks)
go to the reference, which dequantizes once for the whole chunk. Where the library cannot be
built (``build.load``), every call goes to the reference."""
from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from localctx.backends.torch.cpu_kernels import build
from localctx.kvcache.quant_attention import AttentionResult, FullTokens, QuantGroups, attend_reference

MAX_QUERIES = 16
MAX_HEAD_DIM = 256  # LC_MAX_D in the C source
MAX_GROUP = 256  # LC_MAX_ROWS
SOURCE = "policy_attention.c"
FULL_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_p = ctypes.c_void_p


class RopeTables(Protocol):
    """What the kernel needs of the model's RoPE: rotate queries, and its cos/sin tables."""

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def half_tables(self, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin [≥ n_positions, D/2], contiguous."""
        ...


class _Args(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64),
                ("threads", ctypes.c_int64), ("q", _p), ("scale", ctypes.c_double), ("qr", _p), ("q_pos", _p),
                ("G", ctypes.c_int64), ("g", ctypes.c_int64), ("bits", ctypes.c_int64),
                ("k_codes", _p), ("k_scale", _p), ("k_min", _p), ("v_codes", _p), ("v_scale", _p), ("v_min", _p),
                ("g_pos", _p), ("N", ctypes.c_int64), ("full_kind", ctypes.c_int64), ("full_k", _p), ("full_v", _p),
                ("full_pos", _p), ("cos", _p), ("sin", _p), ("scores", _p), ("out", _p), ("failed", ctypes.c_int64)]


def library() -> build.Loaded:
    return build.load(SOURCE)


def available() -> bool:
    return library().ok


def serves(q: torch.Tensor, full: FullTokens, quant: QuantGroups | None) -> bool:
    """Whether a call with these tensors runs in C (else the reference)."""
    T, _, D = q.shape
    return (q.device.type == "cpu" and T <= MAX_QUERIES and D <= MAX_HEAD_DIM and D % 2 == 0
            and (quant is None or (quant.group_size <= MAX_GROUP and quant.uniform_bits is not None))
            and full.k.dtype in FULL_KINDS and available())


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def attend(q: torch.Tensor, q_positions: torch.Tensor, full: FullTokens, quant: QuantGroups | None,
           rope: RopeTables, *, scale: float | None = None, want_mass: bool = False) -> AttentionResult:
    if not serves(q, full, quant):
        return attend_reference(q, q_positions, full, quant, rope, scale=scale, want_mass=want_mass)
    T, Hq, D = q.shape
    Hkv, N = full.k.shape[:2]
    q_pos = q_positions.to(torch.int64).contiguous()
    qf = q.float().contiguous()
    full_k = full.k.transpose(0, 1).contiguous()  # [N, Hkv, D]: the store's own layout
    full_v = full.v.to(full.k.dtype).transpose(0, 1).contiguous()
    full_pos = full.positions.to(torch.int64).contiguous()
    G = 0 if quant is None else quant.n_groups
    g = quant.group_size if G else 1
    n_keys = G * g + N
    cos, sin = rope.half_tables(int(q_pos.max()) + 1)  # keys past every query are masked, never rotated
    scores = torch.empty(Hq * T, n_keys, dtype=torch.float32)
    out = torch.empty(2, T, Hq, D, dtype=torch.float32)  # the result, and the rotated queries
    keep = [qf, q_pos, full_k, full_v, full_pos, cos, sin, scores, out]  # alive until the call returns
    args = _Args(T=T, Hq=Hq, Hkv=Hkv, D=D, threads=torch.get_num_threads(), q=_ptr(qf),
                 scale=scale if scale is not None else D ** -0.5, qr=_ptr(out[1]), q_pos=_ptr(q_pos),
                 N=N, full_kind=FULL_KINDS[full_k.dtype], full_k=_ptr(full_k), full_v=_ptr(full_v),
                 full_pos=_ptr(full_pos), cos=_ptr(cos), sin=_ptr(sin), scores=_ptr(scores), out=_ptr(out[0]))
    if G:
        parts = [t.contiguous() for t in (quant.k.codes, quant.k.scale, quant.k.min, quant.v.codes,
                                          quant.v.scale, quant.v.min, quant.positions.to(torch.int64))]
        keep += parts
        args.G, args.g, args.bits = G, g, quant.uniform_bits
        (args.k_codes, args.k_scale, args.k_min, args.v_codes, args.v_scale, args.v_min,
         args.g_pos) = (_ptr(t) for t in parts)
    library().library.lc_attend(ctypes.byref(args))
    if args.failed:
        raise MemoryError("the CPU attention kernel could not allocate its accumulators")
    result = out[0].to(q.dtype)
    if not want_mass:
        return AttentionResult(result)
    mass = scores.sum(dim=0)  # [L]: the probabilities summed over query heads and tokens
    quant_mass = mass[:G * g].reshape(G, g) if G else None
    return AttentionResult(result, mass[G * g:], quant_mass)
