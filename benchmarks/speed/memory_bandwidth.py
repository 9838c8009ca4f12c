"""Memory bandwidth of this CPU, measured the ways the project uses the word.

- ``planner``: what the planner measures and caches (``backends.hardware.measure_copy_bandwidth``: numpy
  copy of 64 MiB, best of 6, the better of one thread and one thread per core; read + write bytes).
- ``numpy_copy_1t`` / ``numpy_copy_all``: the same copy of a larger buffer by one thread and by all cores.
- ``torch_copy_*`` / ``torch_read_*``: torch's ``copy_`` (read + write bytes) and ``sum`` (read bytes:
  what a decode step does to the weights) with 1 thread and with all cores, when torch is installed.

Every figure is the best of ``--repeats`` (a bandwidth is a ceiling; slower repeats are interference),
with the median beside it. The load average before and after says whether the machine was shared:
on a busy machine every figure reads low.

    python benchmarks/speed/memory_bandwidth.py --json docs/results/torch/benchmarks-memory-bandwidth.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from localctx.backends.machine.detect import cpu_class, cpu_name, measure_copy_bandwidth

GB = 1e9


def timed(fn, nbytes: int, repeats: int) -> dict:
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t0) / GB)
    return {"best_gbs": round(max(rates), 2), "median_gbs": round(statistics.median(rates), 2)}


def numpy_copy(size: int, threads: int, repeats: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    src = np.ones(size // 8)
    dst = np.empty_like(src)
    bounds = [(len(src) * i // threads, len(src) * (i + 1) // threads) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        return timed(lambda: list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds)),
                     2 * src.nbytes, repeats)


def torch_figures(size: int, threads: int, repeats: int) -> dict:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(size // 4)
        dst = torch.empty_like(src)
        return {"copy": timed(lambda: dst.copy_(src), 2 * size, repeats), "read": timed(src.sum, size, repeats)}
    finally:
        torch.set_num_threads(before)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="buffer size for the numpy and torch figures")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    size = args.mib * 2**20
    out = {"cpu": cpu_name(), "cpu_class": cpu_class(), "logical_cores": cores,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average_start": os.getloadavg(),
           "buffer_mib": args.mib, "repeats": args.repeats,
           "command": "python benchmarks/speed/memory_bandwidth.py " + " ".join(argv or sys.argv[1:])}
    out["planner_gbs"] = round(measure_copy_bandwidth() / GB, 2)
    out["numpy_copy_1t"] = numpy_copy(size, 1, args.repeats)
    out["numpy_copy_all"] = numpy_copy(size, cores, args.repeats)
    try:
        for threads, name in ((1, "1t"), (cores, "all")):
            t = torch_figures(size, threads, args.repeats)
            out[f"torch_copy_{name}"], out[f"torch_read_{name}"] = t["copy"], t["read"]
    except ImportError:
        out["torch"] = "not installed"
    out["load_average_end"] = os.getloadavg()
    for key, value in out.items():
        print(f"{key:18} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
