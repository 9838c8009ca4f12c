"""Shared pieces of benchmarks/cuda_check/one_run.py: the time budget, the timers, the copy-bandwidth
measurement, and the sizes each mode runs (``gpu``: the real shapes; ``smoke``: tiny shapes on
CPU through Triton's interpreter, the same code paths)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Budget:
    """The whole run's time; each phase may run until its deadline (seconds since the start), so
    time a phase leaves unused rolls forward to the next one."""
    total_s: float
    start: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def clock(self, deadline_fraction: float) -> "PhaseClock":
        return PhaseClock(self, self.total_s * deadline_fraction)


@dataclass
class PhaseClock:
    budget: Budget
    deadline: float  # seconds since the run started

    def left(self) -> float:
        return self.deadline - self.budget.elapsed()

    def allows(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, reps: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()``: CUDA events around each call on a GPU (the GPU's time,
    launch gaps included), a wall clock on CPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def graph_median_ms(fn, reps: int, device: torch.device) -> tuple[float | None, str | None]:
    """Median ms of a CUDA-graph replay of ``fn`` (launch overhead excluded): (ms, None), or
    (None, why) on CPU or when capture fails."""
    if device.type != "cuda":
        return None, "no CUDA graphs on CPU"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        return None, f"capture failed: {str(exc).splitlines()[0][:200]}"
    return median_ms(graph.replay, reps, 2, device), None


def copy_bandwidth(device: torch.device, n_bytes: int, reps: int) -> dict:
    """Device-to-device copy of ``n_bytes``: GB/s counts the bytes read and written (2 × size)."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps, 3, device)
    return {"bytes": n_bytes, "median_ms": ms, "gbs": 2 * n_bytes / (ms * 1e-3) / 1e9, "reps": reps,
            "method": "torch Tensor.copy_ between two uint8 tensors, " + ("CUDA events" if device.type == "cuda"
                                                                          else "wall clock")}


# -- sizes --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelGrid:
    head_dims: tuple[int, ...]
    gqa: tuple[int, ...]  # query heads per KV head
    bits: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    kv_heads: int  # per case (2 keeps the grid cheap; GQA is the ratio)
    group: int  # quantization group of the attention cases (the policy default)
    append_groups: tuple[int, ...]  # group sizes of the quantise-and-append cases
    near_groups: int  # quantized groups of a "near" policy case
    residual: int  # full-precision tokens after the groups (sinks ahead of them: 4 more)
    near_keys: int  # keys of a "near" paged case
    far_keys: int  # keys of a "far" case: positions reach past 65,536
    far_offset: int  # added to every position of a "far" policy case (0: the keys themselves reach it)
    sinks: int
    window: int
    block_size: int


@dataclass(frozen=True)
class DecodeSizes:
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    group: int
    residual: int
    dtype: torch.dtype
    reps: int
    warmup: int


@dataclass(frozen=True)
class ModelSizes:
    contexts: tuple[int, ...]
    policies: tuple[str, ...]
    dtype: torch.dtype
    steps: int  # timed decode steps per case (median)
    warmup: int
    fill_chunk: int  # tokens appended per layer per fill step (as a chunked prefill leaves the cache)


@dataclass(frozen=True)
class Sizes:
    kernels: KernelGrid
    decode: DecodeSizes
    model: ModelSizes
    copy_bytes: int
    copy_reps: int


def gpu_sizes() -> Sizes:
    return Sizes(
        kernels=KernelGrid(head_dims=(64, 128), gqa=(1, 4, 8), bits=(4, 8), dtypes=(torch.float32, torch.bfloat16),
                           kv_heads=2, group=32, append_groups=(32, 64), near_groups=130, residual=137, near_keys=4109, far_keys=66_000,
                           far_offset=0, sinks=4, window=1000, block_size=16),
        decode=DecodeSizes(contexts=(4096, 32768, 131072), batches=(1, 8), heads=32, kv_heads=8, head_dim=128,
                           group=32, residual=128, dtype=torch.float16, reps=50, warmup=10),
        model=ModelSizes(contexts=(4096, 32768, 131072),
                         policies=("fp16", "int8", "int4+res128", "fp16+sink4+win4096"),
                         dtype=torch.bfloat16, steps=24, warmup=4, fill_chunk=4096),
        copy_bytes=1 << 30, copy_reps=20)


def smoke_sizes() -> Sizes:
    """Tiny shapes for TRITON_INTERPRET on CPU (fp32 only there). Positions past 64K come from an
    offset on the policy kernel's positions; the paged kernel's positions are its key indices, and
    65K keys take minutes in the interpreter, so its "far" cases hold 100 keys here."""
    return Sizes(
        kernels=KernelGrid(head_dims=(64, 128), gqa=(1, 4), bits=(4, 8), dtypes=(torch.float32,),
                           kv_heads=1, group=32, append_groups=(32,), near_groups=2, residual=9, near_keys=45,
                           far_keys=100,
                           far_offset=70_000, sinks=4, window=24, block_size=16),
        decode=DecodeSizes(contexts=(96, 160), batches=(1, 2), heads=4, kv_heads=1, head_dim=64, group=32,
                           residual=32, dtype=torch.float32, reps=2, warmup=1),
        model=ModelSizes(contexts=(96, 160), policies=("fp16", "int8", "int4+res16", "fp16+sink4+win32"),
                         dtype=torch.float32, steps=2, warmup=1, fill_chunk=64),
        copy_bytes=16 << 20, copy_reps=5)
