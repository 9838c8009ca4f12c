"""The machine a bench ran on (for the report) and a memory-bandwidth probe for the roofline when
the planner's hardware detection is not available."""
from __future__ import annotations

import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def describe_machine() -> dict:
    import psutil

    return {"cpu": cpu_name(), "machine": platform.machine(), "system": f"{platform.system()} {platform.release()}",
            "logical_cores": psutil.cpu_count(logical=True), "physical_cores": psutil.cpu_count(logical=False),
            "memory_bytes": psutil.virtual_memory().total, "python": platform.python_version(),
            "load_average_start": load_average()}


def probe_bandwidth(threads: int, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a multi-threaded numpy copy (each byte read once and written once), best of
    ``repeats``. A copy is what decode does to memory: stream big arrays through the cores once."""
    import numpy as np

    n = megabytes * 1024 * 1024 // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    bounds = np.linspace(0, n, threads + 1, dtype=np.int64)
    chunks = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def copy(chunk: tuple[int, int]) -> None:
        a, b = chunk
        np.copyto(dst[a:b], src[a:b])  # releases the GIL: the threads copy in parallel

    best = float("inf")
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(copy, chunks))
            best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best
