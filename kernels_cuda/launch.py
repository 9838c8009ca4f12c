"""Host side of the split-K attention kernels: lays out queries and the two key segments,
picks the key tile and the split count, launches partial → merge (→ mass) and reshapes the result.

Both public wrappers (``quant_attention.attend`` for the policy cache, ``paged_attention`` for
the full-precision block pool) describe their cache with the dataclasses below.

**How the launch is chosen** (``choose_launch``), from the compiled resource use that
``benchmarks/cuda_check/compile.py`` measured (``resource_table.json`` beside this file: registers,
shared memory and warps of ``partial_kernel`` per head dim, dtype, key segment and key tile, for
sm_89 and sm_90) and the occupancy arithmetic of ``occupancy.py``:

1. Key tile ``BLOCK_N``: the largest of ``block_n_choices(head_dim)`` whose compiled kernel has no
   spill and keeps at least ``MIN_RESIDENT`` programs per SM (one program's memory wait hides
   behind another's); else the smallest without a spill. Larger tiles mean fewer loop trips and
   wider loads. The choices themselves come from the compiled numbers: 64 keys only at head dim 64.
2. Warps: the table row's (``compile.py`` compiles each kernel with ``num_warps``'s default, four or
   eight by tile size); ``num_warps`` where the table has no row. Every launch of
   ``partial_kernel``/``mass_kernel`` passes ``maxnreg``, the registers one block of those warps may
   hold (``occupancy.register_cap``): left alone, ptxas held some kernels to 128 registers and spilled.
3. Splits: enough programs for one full wave, SMs × resident programs per SM, divided among the
   (sequence, KV head, row block) programs, capped by the key tiles and ``MAX_SPLITS``.

**Only spill-free specializations are launched**: on a GPU, a table row with spills is never
chosen, and a launch whose only candidates spill (or that the table lacks) raises instead of
running; ``tests/kernels_cuda/test_cuda_resources.py`` checks that the committed table has a
spill-free row for everything the launcher can meet.

The SM count is the device's own; the resources are those of the device's architecture when the
table has it, else sm_89's (the RTX 4090, the design target: 128 SMs). On CPU (Triton's
interpreter) the same tile rule runs on sm_89's numbers and the splits stay at most 4 (the
interpreter runs programs one after another). An explicit ``LaunchConfig`` overrides either."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from localctx.kernels_cuda import attention_kernels as K
from localctx.kernels_cuda import occupancy

LOG2E = 1.4426950408889634
BLOCK_M = 16  # query rows per program (tl.dot needs at least 16)
BLOCK_N_CHOICES = (32, 64)  # key tiles the launcher may pick (each <= the rope table's 64 rows) ...
# ... at head dim 64 only: a tile is worth compiling where it can keep MIN_RESIDENT programs per SM, and
# at head dims 128 and 256 a 64-key tile takes about 54 and 106 KiB of shared memory (trial compiles for
# sm_89 while writing this; not in the committed results), one program per SM at most on the 4090
LARGE_TILE_HEAD_DIMS = (64,)
MIN_RESIDENT = 2  # programs per SM a larger tile must keep
# warps of a specialization the table has no row for (compile.py's first pass): eight once a key tile
# holds WIDE_TILE elements (tile keys × head dim), else four; the table then says where four spilled
WIDE_TILE = 8192
MAX_SPLITS = 64
DESIGN_ARCH = "sm_89"
LIMITS = occupancy.ARCHS[DESIGN_ARCH]  # register file: the same 64K × 32-bit on sm_89 and sm_90
TABLE = Path(__file__).with_name("resource_table.json")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Queries:
    q: torch.Tensor  # [B, T, n_heads, D], already rotated
    positions: torch.Tensor  # [B, T] in-cache positions


@dataclass(frozen=True)
class FullSegment:
    """Full-precision tokens: token j of sequence b is at block ``block_table[b, j // block_size]``,
    offset ``j % block_size``; ``k``/``v`` are indexed (block, token, head, channel) by the strides."""
    k: torch.Tensor
    v: torch.Tensor
    k_strides: tuple[int, int, int]  # block, token, head (channel stride must be 1)
    v_strides: tuple[int, int, int]
    block_table: torch.Tensor  # [B, n_blocks] int32
    block_size: int
    positions: torch.Tensor  # [B, L] (or [1, L] shared: batch stride 0) in-cache positions
    n_tokens: torch.Tensor  # [B] int32
    max_tokens: int  # host-side bound on n_tokens (sizes the grid; never read from the device)
    n_kv_heads: int


@dataclass(frozen=True)
class QuantSegment:
    """Quantized groups in the ``kvcache/quant.py`` layout, addressed through a group table."""
    k_codes: torch.Tensor  # [n_groups_pool, Hkv, g, D*bits/8] uint8
    k_scale: torch.Tensor  # [.., Hkv, 1, D] fp16
    k_min: torch.Tensor
    v_codes: torch.Tensor  # [.., Hkv, g, D*bits/8]
    v_scale: torch.Tensor  # [.., Hkv, g, D/g]
    v_min: torch.Tensor
    group_table: torch.Tensor  # [B, G] int32
    positions: torch.Tensor  # [B, G, g] in-cache positions
    n_groups: torch.Tensor  # [B] int32
    bits: int
    group_size: int


@dataclass(frozen=True)
class KeyMask:
    """Keys visible besides causality: the first ``sinks`` positions and the last ``window``
    (None: every earlier key)."""
    sinks: int = 0
    window: int | None = None


@dataclass(frozen=True)
class LaunchConfig:
    splits: int | None = None  # None: one full wave of programs (choose_launch)
    block_n: int | None = None  # full-precision keys per tile; None: choose_launch


def segment_name(bits: int | None, group: int | None, rope: bool) -> str:
    """The key segment a partial_kernel specialization reads: ``int4-g32`` or ``fp-rope``/``fp-norope``."""
    return f"int{bits}-g{group}" if bits else ("fp-rope" if rope else "fp-norope")


def table_key(head_dim: int, dtype: str, segment: str, block_n: int) -> str:
    return f"d{head_dim}/{dtype}/{segment}/bn{block_n}"


MASS = "mass/"  # the table key prefix of mass_kernel's rows (partial_kernel's have none)


@functools.cache
def resource_table() -> dict:
    """{arch: {table_key: {"registers", "shared", "warps", "spills"}}}: partial_kernel's rows, and
    mass_kernel's under ``MASS`` + key; each row is the fewest warps that compiled without a spill."""
    return json.loads(TABLE.read_text())["archs"]


def num_warps(head_dim: int, tile_keys: int) -> int:
    """Warps per program where the table has no row: eight once a tile of ``tile_keys`` keys (a
    quantized group or BLOCK_N) holds ``WIDE_TILE`` elements, else four."""
    return 8 if head_dim * tile_keys >= WIDE_TILE else 4


def table_warps(arch: str, key: str, default: int) -> int:
    """The warps a specialization launches with: its table row's (the fewest warps that compiled
    without a spill, else the variant that spilled least); ``default`` when the table lacks the key."""
    row = resource_table().get(arch, {}).get(key)
    return default if row is None else row["warps"]


def block_n_choices(head_dim: int) -> tuple[int, ...]:
    """The key tiles the launcher considers at ``head_dim`` (what compile.py compiles)."""
    return BLOCK_N_CHOICES if head_dim in LARGE_TILE_HEAD_DIMS else BLOCK_N_CHOICES[:1]


@dataclass(frozen=True)
class Launch:
    block_n: int
    splits: int
    warps: int  # partial_kernel's
    mass_warps: int  # mass_kernel's
    arch: str  # whose compiled resources decided
    resident: int  # programs per SM of the chosen tile


@dataclass(frozen=True)
class DeviceView:
    arch: str  # a key of the resource table
    sms: int
    interpreter: bool = False

    @classmethod
    def of(cls, device: torch.device) -> "DeviceView":
        if device.type != "cuda":
            return cls(DESIGN_ARCH, occupancy.ARCHS[DESIGN_ARCH].sms, interpreter=True)
        props = torch.cuda.get_device_properties(device)
        name = f"sm_{props.major}{props.minor}"
        return cls(name if name in resource_table() else DESIGN_ARCH, props.multi_processor_count)


def resident_programs(arch: str, key: str) -> int:
    """Programs of one partial_kernel specialization that fit on an SM of ``arch`` (0: does not fit,
    or the table lacks the key)."""
    row = resource_table()[arch].get(key)
    if row is None:
        return 0
    return occupancy.occupancy(occupancy.ARCHS[arch], row["registers"], row["shared"], row["warps"]).blocks_per_sm


def spills(arch: str, key: str) -> bool:
    row = resource_table()[arch].get(key)
    return row is None or bool(row["spills"])


def choose_launch(view: DeviceView, head_dim: int, dtype: str, segment: str, n_tiles_of, programs: int,
                  config: LaunchConfig = LaunchConfig(), group: int = 0) -> Launch:
    """The key tile, warps and split count (rule in the module docstring); ``n_tiles_of(block_n)``
    gives the key tiles for a tile size, ``programs`` the (sequence, KV head, row block) programs,
    ``group`` the quantized group size (0: none)."""
    choices = block_n_choices(head_dim)
    resident = {bn: resident_programs(view.arch, table_key(head_dim, dtype, segment, bn)) for bn in choices}
    if config.block_n is not None:
        block_n = config.block_n
    else:
        clean = [bn for bn in choices if not spills(view.arch, table_key(head_dim, dtype, segment, bn))]
        if not clean and not view.interpreter:
            raise RuntimeError(f"no key tile of partial_kernel compiled without a spill for head dim {head_dim}, "
                               f"{dtype}, {segment} on {view.arch}; run benchmarks/cuda_check/compile.py --table "
                               f"{TABLE.name}")
        fits = [bn for bn in clean if resident[bn] >= MIN_RESIDENT]
        block_n = max(fits) if fits else min(clean or choices)
    n_tiles = max(n_tiles_of(block_n), 1)
    per_sm = max(resident.get(block_n, 0), 1)
    if config.splits is not None:
        splits = config.splits
    elif view.interpreter:
        splits = 4
    else:
        splits = math.ceil(view.sms * per_sm / max(programs, 1))
    key = table_key(head_dim, dtype, segment, block_n)
    warps = table_warps(view.arch, key, num_warps(head_dim, max(block_n, group)))
    if not view.interpreter and spills(view.arch, key):
        raise RuntimeError(f"{key} spills registers on {view.arch} (kernels_cuda/{TABLE.name}); the launcher "
                           "launches only specializations that compiled without a spill")
    return Launch(block_n, max(1, min(splits, n_tiles, MAX_SPLITS if config.splits is None else n_tiles)),
                  warps, table_warps(view.arch, MASS + key, warps), view.arch, resident.get(block_n, 0))


def rope_table(inv_freq: torch.Tensor, device: torch.device) -> torch.Tensor:
    """fp32 [inv_freq | cos(off·f) | sin(off·f)] for off < ROPE_TILE, built in float64."""
    inv = inv_freq.to(device=device, dtype=torch.float64)
    angles = torch.outer(torch.arange(K.ROPE_TILE.value, device=device, dtype=torch.float64), inv)
    return torch.cat([inv, angles.cos().reshape(-1), angles.sin().reshape(-1)]).to(torch.float32)


def run_attention(queries: Queries, full: FullSegment, quant: QuantSegment | None, *,
                  inv_freq: torch.Tensor | None, scale: float, mask: KeyMask = KeyMask(),
                  want_mass: bool = False, config: LaunchConfig = LaunchConfig()
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns out [B, T, n_heads, D] (q's dtype) and, with ``want_mass``, the per-key mass
    [B, G*g + L] (quantized keys first, summed over all query heads and new tokens)."""
    q = queries.q
    B, T, Hq, D = q.shape
    Hkv = full.n_kv_heads
    rep = Hq // Hkv
    rows = T * rep
    dev = q.device
    qg = q.reshape(B, T, Hkv, rep, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, rows, D).contiguous()
    qpos = queries.positions.to(torch.int64).repeat_interleave(rep, dim=1).contiguous()
    g = quant.group_size if quant is not None else 16
    max_groups = quant.group_table.shape[1] if quant is not None else 0
    m_blocks = math.ceil(rows / BLOCK_M)
    segment = segment_name(quant.bits if quant is not None else None, g, inv_freq is not None)
    chosen = choose_launch(DeviceView.of(dev), D, DTYPE_NAMES.get(q.dtype, str(q.dtype)), segment,
                           lambda bn: max_groups + math.ceil(full.max_tokens / bn), B * Hkv * m_blocks, config,
                           group=g if quant is not None else 0)
    block_n, splits = chosen.block_n, chosen.splits
    if max(g, block_n) > K.ROPE_TILE.value:
        raise ValueError(f"tiles of {max(g, block_n)} keys exceed the rope table ({K.ROPE_TILE.value})")
    n_tiles = max_groups + math.ceil(full.max_tokens / block_n)
    o_part = torch.empty((B, Hkv, splits, rows, D), dtype=torch.float32, device=dev)
    m_part = torch.empty((B, Hkv, splits, rows), dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    dummy = qpos  # stands in for the pointers of an absent segment (never read)
    qz = quant
    rope = rope_table(inv_freq, dev) if inv_freq is not None else dummy
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    window = mask.window or 0
    qk_scale = scale * LOG2E
    quant_args = ((qz.k_codes, qz.k_scale, qz.k_min, qz.v_codes, qz.v_scale, qz.v_min, qz.group_table,
                   qz.positions, qz.n_groups) if qz is not None else (dummy,) * 9)
    fpos_stride = full.positions.stride(0) if full.positions.shape[0] > 1 else 0
    common = dict(HEAD_DIM=D, GROUP=g, BITS=qz.bits if qz is not None else 8, HAS_QUANT=qz is not None,
                  ROPE=inv_freq is not None, PRECISION=precision)
    K.partial_kernel[(B * Hkv, m_blocks, splits)](
        qg, qpos, rope, *quant_args,
        full.k, full.v, full.block_table, full.positions, full.n_tokens,
        o_part, m_part, l_part,
        rows, Hkv, max_groups, full.block_size, full.block_table.shape[1], fpos_stride,
        *full.k_strides, *full.v_strides, qk_scale, mask.sinks, window, splits,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, num_warps=chosen.warps,
        maxnreg=occupancy.register_cap(LIMITS, chosen.warps), **common)
    out = torch.empty((B, Hkv, rows, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, Hkv, rows), dtype=torch.float32, device=dev)
    K.merge_kernel[(B * Hkv, m_blocks)](o_part, m_part, l_part, out, lse, rows, splits,
                                         BLOCK_M=BLOCK_M, HEAD_DIM=D)
    result = out.reshape(B, Hkv, T, rep, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    if not want_mass:
        return result, None
    if not DeviceView.of(dev).interpreter and spills(chosen.arch, MASS + table_key(
            D, DTYPE_NAMES.get(q.dtype, str(q.dtype)), segment, block_n)):
        raise RuntimeError(f"mass_kernel spills registers on {chosen.arch} at this shape (kernels_cuda/"
                           f"{TABLE.name}); the launcher launches only specializations that compiled without a spill")
    n_keys = max_groups * g + full.max_tokens
    mass = torch.zeros((B, Hkv, n_keys), dtype=torch.float32, device=dev)
    quant_key_args = quant_args[:3] + quant_args[6:] if qz is not None else (dummy,) * 6
    K.mass_kernel[(B * Hkv, n_tiles)](
        qg, qpos, lse, rope, *quant_key_args,
        full.k, full.block_table, full.positions, full.n_tokens, mass,
        rows, Hkv, max_groups, full.block_size, full.block_table.shape[1], fpos_stride, n_keys,
        *full.k_strides, qk_scale, mask.sinks, window,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, num_warps=chosen.mass_warps,
        maxnreg=occupancy.register_cap(LIMITS, chosen.mass_warps), **common)
    return result, mass.sum(dim=1)
