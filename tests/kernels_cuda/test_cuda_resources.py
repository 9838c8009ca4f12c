"""The arithmetic behind benchmarks/cuda_check/compile.py and the launcher's choice, without compiling:
the tool output parsers on real ptxas/cuobjdump text, the occupancy of hand-computed cases, the
launch rule on a made-up table, and the committed table's coverage of what the launcher can pick."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from localctx.kernels_cuda import dispatch, launch, occupancy

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "cuda_check"))
import resources  # noqa: E402  (benchmarks/cuda_check/resources.py)

_spec = importlib.util.spec_from_file_location("cuda_compile", ROOT / "benchmarks" / "cuda_check" / "compile.py")
compile_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_script)
sys.path.remove(str(ROOT / "benchmarks" / "cuda_check"))

# real output of Triton 3.9's ptxas (CUDA 13.1, sm_90a) for merge_kernel, and of a spilling kernel (sm_89)
PTXAS_OK = ("ptxas-blackwell info    : 11 bytes gmem\n"
            "ptxas-blackwell info    : Compiling entry function 'merge_kernel' for 'sm_90a'\n"
            "ptxas-blackwell info    : Function properties for merge_kernel\n"
            "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
            "ptxas-blackwell info    : Used 40 registers, used 1 barriers\n"
            "ptxas-blackwell info    : Compile time = 224.928 ms\n")
PTXAS_SPILL = ("ptxas info    : 0 bytes gmem\n"
               "ptxas info    : Compiling entry function 'partial_kernel' for 'sm_89'\n"
               "ptxas info    : Function properties for partial_kernel\n"
               "    1248 bytes stack frame, 2838 bytes spill stores, 2216 bytes spill loads\n"
               "ptxas info    : Used 255 registers, 384 bytes smem, 560 bytes cmem[0]\n")
CUOBJDUMP = ("\nResource usage:\n Common:\n  GLOBAL:11 CONSTANT[4]:8\n Function merge_kernel:\n"
             "  REG:40 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:592 TEXTURE:0 SURFACE:0 SAMPLER:0\n")


def test_ptxas_log_parsed():
    assert resources.parse_ptxas(PTXAS_OK, "merge_kernel") == resources.PtxasInfo(40, 0, 0, 0, 0)
    assert resources.parse_ptxas(PTXAS_SPILL, "partial_kernel") == resources.PtxasInfo(255, 2838, 2216, 1248, 384)
    with pytest.raises(ValueError, match="no resource lines for 'mass_kernel'"):
        resources.parse_ptxas(PTXAS_OK, "mass_kernel")


def test_cuobjdump_resource_usage_parsed():
    assert resources.parse_cuobjdump(CUOBJDUMP, "merge_kernel") == resources.CubinInfo(40, 0, 1024, 0)
    with pytest.raises(ValueError, match="partial_kernel"):
        resources.parse_cuobjdump(CUOBJDUMP, "partial_kernel")


SM89, SM90 = occupancy.ARCHS["sm_89"], occupancy.ARCHS["sm_90"]


@pytest.mark.parametrize("limits,regs,smem,warps,blocks,limiter", [
    # 56 regs → 1,792 per warp → 36 warps of 64K registers → 9 blocks of 4 warps (smem: 88; warps: 12)
    (SM89, 56, 64, 4, 9, "registers"),
    # 96 regs → 3,072 per warp → 21 warps → 5 blocks of 4
    (SM89, 96, 64, 4, 5, "registers"),
    # 49,152 B + 1 KiB reserved = 50,176 B → 2 blocks in 100 KiB (registers alone: 4)
    (SM89, 128, 49152, 4, 2, "shared memory"),
    # the same block on sm_90: 228 KiB / 50,176 B = 4, registers also 4 → the first named limit
    (SM90, 128, 49152, 4, 4, "registers"),
    # 16 regs, 1 warp: registers 128 blocks, warps 48, block slots 24
    (SM89, 16, 0, 1, 24, "blocks"),
    # 32 regs, 8 warps: registers 8 blocks, warps 6
    (SM89, 32, 0, 8, 6, "warps"),
    # 255 regs round up to 256 → 8,192 per warp → 8 warps → 1 block of 8 warps on either arch
    (SM90, 255, 0, 8, 1, "registers"),
    # 108,544 B is more than the 99 KiB a block may use on sm_89, within sm_90's 227 KiB
    (SM89, 200, 108544, 4, 0, "does not fit"),
    (SM90, 128, 108544, 4, 2, "shared memory"),
])
def test_occupancy_hand_computed(limits, regs, smem, warps, blocks, limiter):
    occ = occupancy.occupancy(limits, regs, smem, warps)
    assert (occ.blocks_per_sm, occ.limiter) == (blocks, limiter)
    assert occ.warps_per_sm == blocks * warps
    assert occ.fraction == pytest.approx(blocks * warps / limits.max_warps_per_sm)


def test_arch_names():
    assert occupancy.arch("sm_89") is SM89 and occupancy.arch("sm90") is SM90
    with pytest.raises(ValueError, match="unknown architecture 'sm_80'"):
        occupancy.arch("sm_80")


@pytest.fixture
def table(monkeypatch):
    """A made-up table: at d64 the 64-key tile keeps 2 programs per SM on sm_89 with fp16 and spills
    with bf16; at d256 only the 32-key tile is a choice."""
    row = lambda regs, smem, warps, spills=0: {"registers": regs, "shared": smem, "warps": warps, "spills": spills}
    rows = {launch.table_key(64, "fp16", "int4-g32", 32): row(96, 16384, 4),
            launch.table_key(64, "fp16", "int4-g32", 64): row(168, 40960, 4),
            launch.table_key(64, "bf16", "int4-g32", 32): row(96, 16384, 4),
            launch.table_key(64, "bf16", "int4-g32", 64): row(255, 40960, 4, spills=96),
            launch.table_key(256, "fp16", "int4-g32", 32): row(128, 30000, 8)}
    monkeypatch.setattr(launch, "resource_table", lambda: {"sm_89": rows})


def test_launch_takes_the_larger_tile_while_two_programs_fit(table):
    view = launch.DeviceView("sm_89", 128)
    tiles = lambda bn: 32768 // bn
    # 64 keys: 168 regs → 5,376/warp → 12 warps → 3 blocks; 40 KiB + 1 KiB → 2 blocks: 2 resident
    got = launch.choose_launch(view, 64, "fp16", "int4-g32", tiles, programs=8)
    assert (got.block_n, got.resident) == (64, 2)
    assert got.splits == min(launch.MAX_SPLITS, math.ceil(128 * 2 / 8))  # one wave: 256 programs over 8
    # the bf16 64-key tile spills: 32 keys (96 regs → 5 blocks; 16 KiB + 1 KiB → 5 blocks)
    got = launch.choose_launch(view, 64, "bf16", "int4-g32", tiles, programs=64)
    assert (got.block_n, got.resident, got.splits) == (32, 5, 10)
    # d256 considers 32 keys only: 128 regs × 8 warps → 2 blocks (shared memory would allow 3)
    got = launch.choose_launch(view, 256, "fp16", "int4-g32", tiles, programs=64)
    assert (got.block_n, got.resident, got.splits) == (32, 2, 4)
    # a short context caps the splits at its tiles; an explicit config wins
    assert launch.choose_launch(view, 64, "fp16", "int4-g32", lambda bn: 3, programs=8).splits == 3
    fixed = launch.choose_launch(view, 64, "fp16", "int4-g32", tiles, 8, launch.LaunchConfig(splits=5, block_n=32))
    assert (fixed.block_n, fixed.splits) == (32, 5)
    # a spilling row is never launched on a GPU, even when a config asks for its tile
    with pytest.raises(RuntimeError, match="d64/bf16/int4-g32/bn64 spills registers on sm_89"):
        launch.choose_launch(view, 64, "bf16", "int4-g32", tiles, 64, launch.LaunchConfig(block_n=64))
    # a shape the table lacks: no spill-free row, so a GPU refuses; the interpreter takes the smallest tile
    with pytest.raises(RuntimeError, match="no key tile of partial_kernel compiled without a spill"):
        launch.choose_launch(view, 64, "bf16", "fp-rope", tiles, 8)
    cpu = launch.DeviceView("sm_89", 128, interpreter=True)
    assert launch.choose_launch(cpu, 64, "bf16", "fp-rope", tiles, 8).block_n == 32


def test_warps_come_from_the_table_rows(table):
    """A row gives its warps (mass rows under their prefix); a key without a row takes the tile-size
    default, and mass_kernel without a row takes partial_kernel's."""
    rows = launch.resource_table()["sm_89"]
    got = launch.choose_launch(launch.DeviceView("sm_89", 128), 64, "fp16", "int4-g32", lambda bn: 64, 8)
    assert (got.block_n, got.warps, got.mass_warps) == (64, 4, 4)
    rows[launch.MASS + launch.table_key(64, "fp16", "int4-g32", 64)] = {"registers": 96, "shared": 8192, "warps": 8,
                                                                       "spills": 0}
    got = launch.choose_launch(launch.DeviceView("sm_89", 128), 64, "fp16", "int4-g32", lambda bn: 64, 8)
    assert (got.block_n, got.warps, got.mass_warps) == (64, 4, 8)
    assert launch.table_warps("sm_89", launch.table_key(256, "fp16", "int4-g32", 32), 4) == 8  # the row's
    assert launch.table_warps("sm_89", "d128/fp16/int4-g64/bn32", launch.num_warps(128, 64)) == 8  # default
    assert launch.num_warps(128, 32) == 4 and launch.num_warps(64, 64) == 4 and launch.num_warps(256, 32) == 8


def test_table_merge_keeps_the_fewest_spill_free_warps():
    row = lambda regs, warps, spills: {"registers": regs, "shared": 1024, "warps": warps, "spills": spills}
    old = {"sm_89": {"k": row(168, 4, 76), "j": row(100, 4, 0)}}
    new = {"sm_89": {"k": [row(150, 8, 0), row(160, 8, 0)], "j": [row(90, 8, 0)],
                     "m": [row(168, 4, 8), row(128, 8, 4), row(128, 16, 20)]}}
    merged = compile_script.merge_table(old, new)["sm_89"]
    assert merged["k"] == row(160, 8, 0)  # the retry's spill-free rows replace the spilling one (max of the two)
    assert merged["j"] == row(100, 4, 0)  # four warps stay where they did not spill
    assert merged["m"] == row(128, 8, 4)  # all spill: the variant that spilled least, still marked


def test_register_cap_is_what_one_block_may_hold():
    assert [occupancy.register_cap(SM89, w) for w in (1, 4, 8, 16, 32)] == [255, 255, 255, 128, 64]
    assert occupancy.register_cap(SM90, 8) == 255 and occupancy.register_cap(SM90, 12) == 168


def test_committed_table_covers_every_choice():
    """Every (head dim, dtype, segment, tile) the launcher can meet has a row on sm_89 and sm_90 that
    fits the SM and compiled without a spill (partial_kernel's and mass_kernel's), and the
    launcher's choice comes from it."""
    table = launch.resource_table()
    for arch in ("sm_89", "sm_90"):
        assert table[arch] and all(row["spills"] == 0 for row in table[arch].values()), arch
    segments = ["fp-norope", "fp-rope"] + [f"int{b}-g{g}" for b in (4, 8) for g in (32, 64)]
    for arch in ("sm_89", "sm_90"):
        limits = occupancy.ARCHS[arch]
        for D in dispatch.KERNEL_HEAD_DIMS:
            for dt in ("fp16", "bf16"):
                for seg in segments:
                    for bn in launch.block_n_choices(D):
                        row = table[arch][launch.table_key(D, dt, seg, bn)]
                        if seg != "fp-norope":  # the mass is the policy cache's (keys rotated in the kernel)
                            assert table[arch][launch.MASS + launch.table_key(D, dt, seg, bn)]["spills"] == 0
                        assert row["warps"] in (4, 8, 16)
                        assert occupancy.occupancy(limits, row["registers"], row["shared"], row["warps"]).blocks_per_sm >= 1
                    chosen = launch.choose_launch(launch.DeviceView(arch, limits.sms), D, dt, seg, lambda bn: 1024, 8)
                    assert chosen.warps == table[arch][launch.table_key(D, dt, seg, chosen.block_n)]["warps"]


def test_dispatch_refuses_other_head_dims_with_a_reason():
    assert [d for d in (32, 64, 96, 128, 192, 256, 512) if dispatch.kernel_supports(d)] == [64, 128, 256]
    assert "head dim 96" in dispatch.kernel_refusal(96) and "64, 128, 256" in dispatch.kernel_refusal(96)
    assert dispatch.kernel_refusal(128) is None
