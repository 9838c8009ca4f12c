"""Triton kernels for split-K decode attention over cached K/V in two segments:

- **quantized groups** (``kvcache/quant.py`` layout): one tile is one group of ``GROUP`` tokens;
  keys per channel (scale/min [D] per group), values per token (scale/min per ``GROUP``
  channels); 4-bit codes two per byte, even channel in the low nibble;
- **full-precision tokens**, paged: token ``j`` of a sequence lives in block
  ``block_table[j // block_size]`` at offset ``j % block_size`` (a contiguous store is one
  block as long as the sequence).

Each program owns one (sequence, KV head, row block, split): the rows are the query heads that
share the KV head times the new tokens (grouped-query attention reads each K/V tile once for
all of them). A split walks its share of the tiles with an online softmax and writes a partial
(output, running max, running sum); ``merge`` combines the splits. Keys may be stored before
RoPE (``ROPE``): they are rotated in registers at their in-cache positions ("rotate half"
pairs channel i with i + D/2). Softmax runs in base 2 (``qk_scale`` includes log2 e).

A key is visible to a row iff its position <= the row's position and, when ``window`` > 0,
it is a sink (position < ``sinks``) or one of the last ``window`` positions.

``mass`` recomputes the probabilities with the merged log-sum-exp and sums them over rows:
the per-key attention mass heavy-hitter eviction accumulates."""
from __future__ import annotations

import triton
import triton.language as tl

NEG_BIG = tl.constexpr(-1.0e30)  # the running max starts finite, so fully masked tiles never make NaNs


ROPE_TILE = tl.constexpr(64)  # offsets covered by the rope table (>= every tile's token count)


@triton.jit
def _rotate(x1, x2, pos, rope_ptr, HALF: tl.constexpr):
    """Rotate a tile of keys. ``rope_ptr``: fp32 [inv_freq (HALF) | cos (ROPE_TILE, HALF) |
    sin (ROPE_TILE, HALF)] of offset × frequency. When the tile's positions span less than
    ROPE_TILE (always for a quantized group; for contiguous full tokens) the angle is split as
    base + offset: one cos/sin per channel for the tile's base and the table for the offsets,
    instead of a (slow, range-reduced) cos/sin per key and channel."""
    half = tl.arange(0, HALF)
    freq = tl.load(rope_ptr + half)
    base = tl.min(pos, 0)
    off = pos - base
    if tl.max(off, 0) < ROPE_TILE:
        a = base.to(tl.float32) * freq
        c0 = tl.cos(a)[None, :]
        s0 = tl.sin(a)[None, :]
        table = rope_ptr + HALF + off[:, None] * HALF + half[None, :]
        co = tl.load(table)
        so = tl.load(table + ROPE_TILE * HALF)
        c = c0 * co - s0 * so
        s = s0 * co + c0 * so
    else:
        angle = pos.to(tl.float32)[:, None] * freq[None, :]
        c = tl.cos(angle)
        s = tl.sin(angle)
    return x1 * c - x2 * s, x2 * c + x1 * s


GROUP_SUB_ELEMS = 2048  # a quantized group is read in sub-tiles of at most this many (token × channel) codes


@triton.constexpr_function
def _group_sub(head_dim, group):
    """Tokens per sub-tile of a quantized group: GROUP_SUB_ELEMS // head_dim (at least 16, the
    smallest tl.dot side), at most the group. Dequantizing a whole 64-token group at head dim
    128/256 held more fp32 values than the registers (compile.py measured the spills)."""
    return max(16, min(group, GROUP_SUB_ELEMS // head_dim))


@triton.jit
def _unpack(codes_ptr, row_off, ch, BITS: tl.constexpr):
    """Codes of channels ``ch`` for the token rows starting at ``row_off`` (bytes), as fp32."""
    if BITS == 4:
        byte = tl.load(codes_ptr + row_off[:, None] + (ch // 2)[None, :]).to(tl.int32)
        return ((byte >> ((ch % 2) * 4)[None, :]) & 15).to(tl.float32)
    else:
        return tl.load(codes_ptr + row_off[:, None] + ch[None, :]).to(tl.float32)


@triton.jit
def _quant_keys(kq_ptr, kqs_ptr, kqm_ptr, gtab_ptr, gpos_ptr, b, h, t, sub, n_kv_heads, max_groups,
                rope_ptr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, BITS: tl.constexpr,
                ROPE: tl.constexpr):
    """Keys ``sub * SUB`` .. ``+ SUB`` of group ``t`` (scale/min are per channel of the whole group)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PACKED: tl.constexpr = HEAD_DIM * BITS // 8
    half = tl.arange(0, HALF)
    tok = sub * SUB + tl.arange(0, SUB)
    gid = tl.load(gtab_ptr + b * max_groups + t).to(tl.int64)
    gh = gid * n_kv_heads + h
    row_off = (gh * GROUP + tok) * PACKED
    s1 = tl.load(kqs_ptr + gh * HEAD_DIM + half).to(tl.float32)
    s2 = tl.load(kqs_ptr + gh * HEAD_DIM + HALF + half).to(tl.float32)
    m1 = tl.load(kqm_ptr + gh * HEAD_DIM + half).to(tl.float32)
    m2 = tl.load(kqm_ptr + gh * HEAD_DIM + HALF + half).to(tl.float32)
    k1 = _unpack(kq_ptr, row_off, half, BITS) * s1[None, :] + m1[None, :]
    k2 = _unpack(kq_ptr, row_off, half + HALF, BITS) * s2[None, :] + m2[None, :]
    pos = tl.load(gpos_ptr + (b * max_groups + t) * GROUP + tok)
    if ROPE:
        k1, k2 = _rotate(k1, k2, pos, rope_ptr, HALF)
    return k1, k2, pos


@triton.jit
def _quant_values(vq_ptr, vqs_ptr, vqm_ptr, gtab_ptr, b, h, t, sub, n_kv_heads, max_groups,
                  HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, BITS: tl.constexpr):
    """Values of tokens ``sub * SUB`` .. ``+ SUB`` of group ``t`` (scale/min per token and GROUP channels)."""
    PACKED: tl.constexpr = HEAD_DIM * BITS // 8
    N_SCALES: tl.constexpr = HEAD_DIM // GROUP
    dim = tl.arange(0, HEAD_DIM)
    tok = sub * SUB + tl.arange(0, SUB)
    gid = tl.load(gtab_ptr + b * max_groups + t).to(tl.int64)
    gh = gid * n_kv_heads + h
    scale_off = ((gh * GROUP + tok) * N_SCALES)[:, None] + (dim // GROUP)[None, :]
    scale = tl.load(vqs_ptr + scale_off).to(tl.float32)
    mn = tl.load(vqm_ptr + scale_off).to(tl.float32)
    return _unpack(vq_ptr, (gh * GROUP + tok) * PACKED, dim, BITS) * scale + mn


@triton.jit
def _full_rows(btab_ptr, b, t, n_full, block_size, max_blocks, BLOCK_N: tl.constexpr):
    j = t * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = j < n_full
    blk = tl.load(btab_ptr + b * max_blocks + j // block_size, mask=ok, other=0).to(tl.int64)
    return j, ok, blk, (j % block_size).to(tl.int64)


@triton.jit
def _full_keys(kf_ptr, btab_ptr, fpos_ptr, b, h, t, n_full, block_size, max_blocks, sf_blk, sf_tok,
               sf_head, s_fpos, rope_ptr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               ROPE: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, HALF)
    j, ok, blk, off = _full_rows(btab_ptr, b, t, n_full, block_size, max_blocks, BLOCK_N)
    base = blk * sf_blk + off * sf_tok + h * sf_head
    k1 = tl.load(kf_ptr + base[:, None] + half[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    k2 = tl.load(kf_ptr + base[:, None] + HALF + half[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    pos = tl.load(fpos_ptr + b * s_fpos + j, mask=ok, other=0)
    pos = tl.where(ok, pos, tl.max(pos, 0))  # padding keys (masked anyway) keep the tile's span short
    if ROPE:
        k1, k2 = _rotate(k1, k2, pos, rope_ptr, HALF)
    return k1, k2, pos, ok


@triton.jit
def _full_values(vf_ptr, btab_ptr, b, h, t, n_full, block_size, max_blocks, sv_blk, sv_tok, sv_head,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    dim = tl.arange(0, HEAD_DIM)
    j, ok, blk, off = _full_rows(btab_ptr, b, t, n_full, block_size, max_blocks, BLOCK_N)
    base = blk * sv_blk + off * sv_tok + h * sv_head
    return tl.load(vf_ptr + base[:, None] + dim[None, :], mask=ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _visible(kpos, key_ok, qpos, sinks, window):
    vis = (kpos[None, :] <= qpos[:, None]) & key_ok[None, :]
    if window > 0:
        vis = vis & ((kpos[None, :] < sinks) | (kpos[None, :] > qpos[:, None] - window))
    return vis


@triton.jit
def _scores(q1, q2, k1, k2, vis, qk_scale, PRECISION: tl.constexpr):
    k1 = k1.to(q1.dtype)
    k2 = k2.to(q1.dtype)
    s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
    s += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
    return tl.where(vis, s * qk_scale, float("-inf"))


@triton.jit
def _online(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of the online softmax; ``v`` is already in the queries' dtype."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_rows(q_ptr, qpos_ptr, pid_bh, b, rows, n_rows, HEAD_DIM: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, HALF)
    ok = rows < n_rows
    base = (pid_bh.to(tl.int64) * n_rows + rows) * HEAD_DIM
    q1 = tl.load(q_ptr + base[:, None] + half[None, :], mask=ok[:, None], other=0.0)
    q2 = tl.load(q_ptr + base[:, None] + HALF + half[None, :], mask=ok[:, None], other=0.0)
    qpos = tl.load(qpos_ptr + b * n_rows + rows, mask=ok, other=-1)
    return q1, q2, qpos, ok


# Arguments that change along a stream (counts, the split count, mask bounds) are not specialized:
# Triton would otherwise compile a new variant when one of them becomes 1 or a multiple of 16
# mid-decode. Strides stay specialized (their divisibility lets loads vectorize; they are fixed by
# the cache layout). benchmarks/cuda_check/compile.py compiles every variant the launcher uses.
STREAM_ARGS = ("n_rows", "n_kv_heads", "max_groups", "block_size", "max_blocks", "s_fpos", "n_splits", "sinks",
               "window", "n_keys_max")


@triton.jit(do_not_specialize=[a for a in STREAM_ARGS if a != "n_keys_max"])
def partial_kernel(q_ptr, qpos_ptr, rope_ptr,
                   kq_ptr, kqs_ptr, kqm_ptr, vq_ptr, vqs_ptr, vqm_ptr, gtab_ptr, gpos_ptr, ngroups_ptr,
                   kf_ptr, vf_ptr, btab_ptr, fpos_ptr, nfull_ptr,
                   o_ptr, m_ptr, l_ptr,
                   n_rows, n_kv_heads, max_groups, block_size, max_blocks, s_fpos,
                   sf_blk, sf_tok, sf_head, sv_blk, sv_tok, sv_head,
                   qk_scale, sinks, window, n_splits,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                   HAS_QUANT: tl.constexpr, ROPE: tl.constexpr, PRECISION: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q1, q2, qpos, row_ok = _load_rows(q_ptr, qpos_ptr, pid_bh, b, rows, n_rows, HEAD_DIM)
    n_groups = 0
    if HAS_QUANT:
        n_groups = tl.load(ngroups_ptr + b)
    n_full = tl.load(nfull_ptr + b)
    n_tiles = n_groups + tl.cdiv(n_full, BLOCK_N)
    per_split = tl.cdiv(n_tiles, n_splits)
    t0 = split * per_split
    t1 = tl.minimum(t0 + per_split, n_tiles)
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if HAS_QUANT:
        SUB: tl.constexpr = _group_sub(HEAD_DIM, GROUP)
        N_SUB: tl.constexpr = GROUP // SUB
        all_ok = tl.full([SUB], 1, tl.int1)
        for u in range(t0 * N_SUB, tl.minimum(t1, n_groups) * N_SUB):  # a group's sub-tiles, one by one
            t = u // N_SUB
            sub = u % N_SUB
            k1, k2, kpos = _quant_keys(kq_ptr, kqs_ptr, kqm_ptr, gtab_ptr, gpos_ptr, b, h, t, sub, n_kv_heads,
                                       max_groups, rope_ptr, HEAD_DIM, GROUP, SUB, BITS, ROPE)
            s = _scores(q1, q2, k1, k2, _visible(kpos, all_ok, qpos, sinks, window), qk_scale, PRECISION)
            v = _quant_values(vq_ptr, vqs_ptr, vqm_ptr, gtab_ptr, b, h, t, sub, n_kv_heads, max_groups,
                              HEAD_DIM, GROUP, SUB, BITS)
            m_i, l_i, acc = _online(s, v.to(q1.dtype), m_i, l_i, acc, PRECISION)
    for t in range(tl.maximum(t0, n_groups), t1):
        tf = t - n_groups
        k1, k2, kpos, key_ok = _full_keys(kf_ptr, btab_ptr, fpos_ptr, b, h, tf, n_full, block_size, max_blocks,
                                          sf_blk, sf_tok, sf_head, s_fpos, rope_ptr, HEAD_DIM, BLOCK_N, ROPE)
        s = _scores(q1, q2, k1, k2, _visible(kpos, key_ok, qpos, sinks, window), qk_scale, PRECISION)
        v = _full_values(vf_ptr, btab_ptr, b, h, tf, n_full, block_size, max_blocks, sv_blk, sv_tok, sv_head,
                         HEAD_DIM, BLOCK_N)
        m_i, l_i, acc = _online(s, v.to(q1.dtype), m_i, l_i, acc, PRECISION)
    part = (pid_bh.to(tl.int64) * n_splits + split) * n_rows + rows
    dim = tl.arange(0, HEAD_DIM)
    tl.store(o_ptr + part[:, None] * HEAD_DIM + dim[None, :], acc, mask=row_ok[:, None])
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["n_rows", "n_splits"])
def merge_kernel(o_part_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, n_rows, n_splits,
                 BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < n_rows
    dim = tl.arange(0, HEAD_DIM)
    m_max = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    for s in range(n_splits):
        m_max = tl.maximum(m_max, tl.load(m_ptr + (pid_bh * n_splits + s) * n_rows + rows, mask=ok, other=NEG_BIG))
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for s in range(n_splits):
        part = (pid_bh * n_splits + s) * n_rows + rows
        w = tl.exp2(tl.load(m_ptr + part, mask=ok, other=NEG_BIG) - m_max)
        total += w * tl.load(l_ptr + part, mask=ok, other=0.0)
        acc += w[:, None] * tl.load(o_part_ptr + part[:, None] * HEAD_DIM + dim[None, :], mask=ok[:, None], other=0.0)
    safe = tl.where(total > 0, total, 1.0)
    out = pid_bh * n_rows + rows
    tl.store(out_ptr + out[:, None] * HEAD_DIM + dim[None, :], (acc / safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=ok[:, None])
    tl.store(lse_ptr + out, m_max + tl.log2(safe), mask=ok)


@triton.jit(do_not_specialize=[a for a in STREAM_ARGS if a != "n_splits"])
def mass_kernel(q_ptr, qpos_ptr, lse_ptr, rope_ptr,
                kq_ptr, kqs_ptr, kqm_ptr, gtab_ptr, gpos_ptr, ngroups_ptr,
                kf_ptr, btab_ptr, fpos_ptr, nfull_ptr, mass_ptr,
                n_rows, n_kv_heads, max_groups, block_size, max_blocks, s_fpos, n_keys_max,
                sf_blk, sf_tok, sf_head, qk_scale, sinks, window,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                BITS: tl.constexpr, HAS_QUANT: tl.constexpr, ROPE: tl.constexpr, PRECISION: tl.constexpr):
    """mass[b, h, key] = sum over the KV head's rows of exp2(score - lse): one program per key tile."""
    pid_bh = tl.program_id(0)
    t = tl.program_id(1)
    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads
    n_groups = 0
    if HAS_QUANT:
        n_groups = tl.load(ngroups_ptr + b)
    n_full = tl.load(nfull_ptr + b)
    out_base = mass_ptr + pid_bh.to(tl.int64) * n_keys_max
    if t < n_groups:
        SUB: tl.constexpr = _group_sub(HEAD_DIM, GROUP)
        all_ok = tl.full([SUB], 1, tl.int1)
        for sub in range(0, GROUP // SUB):
            k1, k2, kpos = _quant_keys(kq_ptr, kqs_ptr, kqm_ptr, gtab_ptr, gpos_ptr, b, h, t, sub, n_kv_heads,
                                       max_groups, rope_ptr, HEAD_DIM, GROUP, SUB, BITS, ROPE)
            k1 = k1.to(q_ptr.dtype.element_ty)
            k2 = k2.to(q_ptr.dtype.element_ty)
            mass = tl.zeros([SUB], tl.float32)
            for mb in range(0, tl.cdiv(n_rows, BLOCK_M)):
                rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
                q1, q2, qpos, ok = _load_rows(q_ptr, qpos_ptr, pid_bh, b, rows, n_rows, HEAD_DIM)
                lse = tl.load(lse_ptr + pid_bh.to(tl.int64) * n_rows + rows, mask=ok, other=0.0)
                s = _scores(q1, q2, k1, k2, _visible(kpos, all_ok, qpos, sinks, window), qk_scale, PRECISION)
                mass += tl.sum(tl.exp2(s - lse[:, None]), 0)
            tl.store(out_base + t * GROUP + sub * SUB + tl.arange(0, SUB), mass)
    elif t - n_groups < tl.cdiv(n_full, BLOCK_N):
        tf = t - n_groups
        k1, k2, kpos, key_ok = _full_keys(kf_ptr, btab_ptr, fpos_ptr, b, h, tf, n_full, block_size, max_blocks,
                                          sf_blk, sf_tok, sf_head, s_fpos, rope_ptr, HEAD_DIM, BLOCK_N, ROPE)
        k1 = k1.to(q_ptr.dtype.element_ty)
        k2 = k2.to(q_ptr.dtype.element_ty)
        mass = tl.zeros([BLOCK_N], tl.float32)
        for mb in range(0, tl.cdiv(n_rows, BLOCK_M)):
            rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            q1, q2, qpos, ok = _load_rows(q_ptr, qpos_ptr, pid_bh, b, rows, n_rows, HEAD_DIM)
            lse = tl.load(lse_ptr + pid_bh.to(tl.int64) * n_rows + rows, mask=ok, other=0.0)
            s = _scores(q1, q2, k1, k2, _visible(kpos, key_ok, qpos, sinks, window), qk_scale, PRECISION)
            mass += tl.sum(tl.exp2(s - lse[:, None]), 0)
        j = tf * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_base + n_groups * GROUP + j, mass, mask=j < n_full)
