"""How many programs (thread blocks) of a compiled kernel fit on one SM, from its resource use and
the architecture's limits: the CUDA occupancy calculator's arithmetic, without a GPU.

A block is held back by whichever runs out first: registers (allocated per warp in units of 256,
so ``regs`` per thread round up to a multiple of 8), shared memory (allocated in 128-byte units,
plus 1 KiB the driver reserves per block on sm_80 and later), warp slots, or the block-slot cap.
The numbers are NVIDIA's published limits for compute capability 8.9 and 9.0 (the CUDA C++
Programming Guide's table of technical specifications; SM counts of the RTX 4090 and H100 SXM).
Pure Python: ``benchmarks/cuda_check/compile.py`` fills its table with it and ``launch.py`` picks
tile sizes and split counts with it."""
from __future__ import annotations

from dataclasses import dataclass

REG_UNIT = 256  # registers are allocated per warp in units of 256
SMEM_UNIT = 128  # bytes
SMEM_RESERVED_PER_BLOCK = 1024  # bytes the driver keeps per resident block (sm_80+)
WARP = 32


@dataclass(frozen=True)
class ArchLimits:
    name: str  # "sm_89"
    capability: int  # 89
    device: str  # the GPU whose SM count is given
    sms: int
    regs_per_sm: int
    max_regs_per_thread: int
    smem_per_sm: int  # bytes, the largest carve-out
    smem_per_block: int  # bytes a block may use (opt-in dynamic shared memory)
    max_warps_per_sm: int
    max_blocks_per_sm: int


ARCHS = {
    "sm_89": ArchLimits("sm_89", 89, "RTX 4090", sms=128, regs_per_sm=65536, max_regs_per_thread=255,
                        smem_per_sm=100 * 1024, smem_per_block=99 * 1024, max_warps_per_sm=48, max_blocks_per_sm=24),
    "sm_90": ArchLimits("sm_90", 90, "H100 SXM", sms=132, regs_per_sm=65536, max_regs_per_thread=255,
                        smem_per_sm=228 * 1024, smem_per_block=227 * 1024, max_warps_per_sm=64, max_blocks_per_sm=32),
}


def arch(name: str) -> ArchLimits:
    key = name.strip().lower().replace("sm", "sm_").replace("sm__", "sm_")
    if key not in ARCHS:
        raise ValueError(f"unknown architecture {name!r}: one of {', '.join(ARCHS)}")
    return ARCHS[key]


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    fraction: float  # resident warps / the SM's warp slots
    limiter: str  # "registers" | "shared memory" | "warps" | "blocks" | "does not fit"
    by_limit: dict  # blocks each limit alone allows


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(limits: ArchLimits, regs: int, smem: int, warps: int) -> Occupancy:
    """Resident blocks per SM of a kernel using ``regs`` registers per thread, ``smem`` bytes of
    shared memory per block (static + dynamic) and ``warps`` warps per block."""
    if warps <= 0 or regs < 0 or smem < 0:
        raise ValueError(f"bad resource use: regs={regs} smem={smem} warps={warps}")
    regs_per_warp = _round_up(max(regs, 1) * WARP, REG_UNIT)
    by_regs = (limits.regs_per_sm // regs_per_warp) // warps
    smem_block = _round_up(smem, SMEM_UNIT) + SMEM_RESERVED_PER_BLOCK
    by_smem = limits.smem_per_sm // smem_block
    by_warps = limits.max_warps_per_sm // warps
    by_limit = {"registers": by_regs, "shared memory": by_smem, "warps": by_warps, "blocks": limits.max_blocks_per_sm}
    if regs > limits.max_regs_per_thread or smem > limits.smem_per_block:
        return Occupancy(0, 0, 0.0, "does not fit", by_limit)
    limiter = min(by_limit, key=lambda k: by_limit[k])  # ties: the first in the order above
    blocks = by_limit[limiter]
    return Occupancy(blocks, blocks * warps, blocks * warps / limits.max_warps_per_sm,
                     limiter if blocks else "does not fit", by_limit)


def register_cap(limits: ArchLimits, warps: int) -> int:
    """The registers per thread a block of ``warps`` warps may use and still fit on one SM (a
    multiple of 8, at most the per-thread maximum): what the launcher passes as Triton's
    ``maxnreg``. Left alone, ptxas sometimes holds a kernel to 128 registers (two blocks per SM)
    and spills rather than use the registers one block may have."""
    return min(limits.max_regs_per_thread, limits.regs_per_sm // (warps * WARP) // 8 * 8)
