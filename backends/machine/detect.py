"""Hardware detection: Apple (sysctl + table), NVIDIA (torch.cuda properties + table), CPU
(psutil + a cached numpy-copy bandwidth microbenchmark, one thread and all cores), and named profiles for machines we do
not have (``--hardware rtx4090``, ``--hardware m2-max-64gb``, ``--hardware cpu-24gb``)."""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from functools import lru_cache
from importlib import resources
from pathlib import Path

from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import GB, GiB, HardwareProfile, cache_dir
from localctx.kvcache.private_files import read_trusted, write_private
_APPLE_NAME = re.compile(r"^m([1-9])(?:-(pro|max|ultra))?-(\d+)gb$")
_CPU_NAME = re.compile(r"^cpu-(\d+)gb$")


@lru_cache(maxsize=1)
def table() -> dict:
    return json.loads(resources.files("localctx.assets").joinpath("hardware.json").read_text())


# -- named profiles -------------------------------------------------------------------------------
def profile_names() -> list[str]:
    t = table()
    apple = [f"{chip.lower().replace(' ', '-')}-{gb}gb" for chip, c in t["apple"]["chips"].items()
             for gb in c["memory_gb"]]
    nvidia = [g["slug"] for g in t["nvidia"]["gpus"].values()]
    return apple + nvidia + list(t["cpu"]["profiles"])


def named(name: str) -> HardwareProfile:
    """A profile for a machine we do not have, e.g. ``rtx4090``, ``m2-max-64gb``, ``cpu-24gb``."""
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    m = _APPLE_NAME.match(key)
    if m:
        chip = f"M{m.group(1)}" + (f" {m.group(2).capitalize()}" if m.group(2) else "")
        return apple_profile(chip, int(m.group(3)) * GiB, key=key)
    for gpu_name, gpu in table()["nvidia"]["gpus"].items():
        if key in (gpu["slug"], gpu["slug"].replace("rtx", "rtx-")):
            return _nvidia_named(gpu_name, gpu)
    cpu = table()["cpu"]["profiles"].get(key)
    if cpu is not None:
        total = cpu["memory_gb"] * GiB
        return HardwareProfile(kind="cpu", name=cpu["name"], memory_bytes=total,
                               free_bytes=total - int(table()["cpu"]["reserved_gb"] * GiB),
                               bandwidth_bytes_s=cpu["bandwidth_gbs"] * GB, bandwidth_source="profile",
                               key=cpu.get("calibration_key", key), compute_flops=cpu["fp16_tflops"] * 1e12, detected=False)
    m = _CPU_NAME.match(key)
    hint = (f"{m.group(1)} GB is not a CPU profile we know; " if m else "")
    raise UserError(f"unknown hardware profile {name!r}; {hint}use one of e.g. rtx4090, rtx4080, rtx3090, "
                    "rtx5090, m1-8gb, m3-pro-36gb, m2-max-64gb, cpu-24gb (`localctx plan --list-hardware`)")


def apple_profile(chip: str, memory: int, key: str = "", detected: bool = False,
                  free: int | None = None) -> HardwareProfile:
    t = table()["apple"]
    info = t["chips"].get(chip)
    if info is None:
        raise UserError(f"unknown Apple chip {chip!r}; known: {', '.join(t['chips'])}")
    gb = round(memory / GiB)
    if not detected and gb not in info["memory_gb"]:
        raise UserError(f"{chip} was not sold with {gb} GB; choose one of "
                        + ", ".join(f"{g} GB" for g in info["memory_gb"]))
    bw = info.get("bandwidth_by_memory", {}).get(str(gb), info["bandwidth_gbs"])
    frac_table = t["gpu_working_set_fraction"]
    frac = frac_table["up_to_36gb"] if gb <= 36 else frac_table["above_36gb"]
    usable = int(memory * frac)
    free_bytes = usable if free is None else min(free, usable)
    return HardwareProfile(
        kind="apple", name=f"Apple {chip}", memory_bytes=memory, free_bytes=free_bytes,
        bandwidth_bytes_s=bw * GB * table()["achievable_fraction"]["apple"], bandwidth_source="table",
        key=key or f"{chip.lower().replace(' ', '-')}-{gb}gb", compute_flops=info["fp16_tflops"] * 1e12,
        detected=detected,
        notes=(f"Metal lets the GPU use about {frac:.0%} of unified memory",))


def _nvidia_named(gpu_name: str, gpu: dict) -> HardwareProfile:
    total = int(gpu["memory_gb"] * GiB)
    return HardwareProfile(
        kind="cuda", name=f"NVIDIA {gpu_name}", memory_bytes=total,
        free_bytes=total - int(table()["nvidia"]["reserved_gb"] * GiB),
        bandwidth_bytes_s=gpu["bandwidth_gbs"] * GB * table()["achievable_fraction"]["cuda"],
        bandwidth_source="table", key=gpu["slug"], compute_flops=gpu["fp16_tflops"] * 1e12, detected=False)


def nvidia_table_entry(device_name: str) -> tuple[str, dict] | None:
    """The longest table name contained in the device name ('NVIDIA GeForce RTX 4090' → 'RTX 4090')."""
    norm = device_name.upper().replace("-", " ")
    hits = [(n, g) for n, g in table()["nvidia"]["gpus"].items() if n.upper().replace("-", " ") in norm]
    return max(hits, key=lambda h: len(h[0])) if hits else None


# -- detection ------------------------------------------------------------------------------------
def detect(measure: bool = True) -> HardwareProfile:
    """This machine: Apple Silicon, else the first NVIDIA GPU, else the CPU."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return detect_apple()
    gpu = detect_nvidia()
    if gpu is not None:
        return gpu
    return detect_cpu(measure=measure)


def _sysctl(name: str) -> str:
    return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()


def detect_apple() -> HardwareProfile:
    import psutil

    brand = _sysctl("machdep.cpu.brand_string")  # "Apple M2 Max"
    memory = int(_sysctl("hw.memsize") or psutil.virtual_memory().total)
    chip = brand.removeprefix("Apple ").strip()
    if chip in table()["apple"]["chips"]:
        return apple_profile(chip, memory, detected=True, free=psutil.virtual_memory().available)
    cpu = detect_cpu()
    return HardwareProfile(kind="apple", name=brand or "Apple Silicon", memory_bytes=memory,
                           free_bytes=int(min(psutil.virtual_memory().available, memory * 0.75)),
                           bandwidth_bytes_s=cpu.bandwidth_bytes_s, bandwidth_source="measured",
                           key=chip.lower().replace(" ", "-"),
                           notes=(f"{brand!r} is not in assets/hardware.json: bandwidth measured on the CPU",))


def detect_nvidia() -> HardwareProfile | None:
    """The first CUDA device through torch, or None (no driver, no torch, no GPU)."""
    if not Path("/proc/driver/nvidia/version").exists() and sys.platform != "win32":
        return None
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return nvidia_profile(props.name, total, free, getattr(props, "memory_clock_rate", 0),
                          getattr(props, "memory_bus_width", 0))


def nvidia_profile(name: str, total: int, free: int, mem_clock_khz: int = 0, bus_width_bits: int = 0
                   ) -> HardwareProfile:
    """Bandwidth from the table when the GPU is known, else from bus width × memory clock (DDR: ×2)."""
    hit = nvidia_table_entry(name)
    frac = table()["achievable_fraction"]["cuda"]
    if hit is not None:
        _, gpu = hit
        bw, source, key, flops = gpu["bandwidth_gbs"] * GB, "table", gpu["slug"], gpu["fp16_tflops"] * 1e12
    elif mem_clock_khz and bus_width_bits:
        bw = 2 * mem_clock_khz * 1e3 * bus_width_bits / 8
        source, key, flops = "bus width x memory clock", re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"), 0.0
    else:
        raise UserError(f"GPU {name!r} is not in assets/hardware.json and its memory clock is unknown; "
                        "plan with --hardware NAME for the closest known GPU")
    return HardwareProfile(kind="cuda", name=name, memory_bytes=int(total), free_bytes=int(min(free, total)),
                           bandwidth_bytes_s=bw * frac, bandwidth_source=source, key=key, compute_flops=flops)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_class() -> str:
    """What CPU calibrations are keyed by: the model name and the core count."""
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_name().lower()).strip("-")
    return f"cpu-{slug}-{cores}c"


BUSY_LOAD_PER_CORE = 0.5  # above this 1-minute load per core, other work shares the cores and the memory bus


def load_per_core() -> float:
    """The 1-minute load average per logical core (0.0 where the OS reports none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return 0.0


def _best_copy(src, dst, repeats: int, threads: int) -> float:
    """Best of ``repeats`` timed copies of src into dst, split across ``threads`` threads (numpy releases
    the GIL while it copies, so the slices run on separate cores); read + write bytes per second."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    bounds = [(len(src) * i // threads, len(src) * (i + 1) // threads) for i in range(threads)]

    def copy(bound: tuple[int, int]) -> None:
        np.copyto(dst[bound[0]:bound[1]], src[bound[0]:bound[1]])

    best = 0.0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(copy, bounds))
            best = max(best, 2 * src.nbytes / (time.perf_counter() - t0))
    return best


def measure_copy_bandwidth(size_bytes: int = 64 * 1024 * 1024, repeats: int = 6) -> float:
    """Copy bandwidth (read + write bytes per second) on a buffer far larger than L2: the best of N copies
    by one thread and by one thread per core at once, whichever is higher (one core alone often cannot
    fill the memory bus that a decode on every core uses)."""
    import numpy as np

    src = np.ones(size_bytes // 8)
    dst = np.empty_like(src)
    threads = os.cpu_count() or 1
    one = _best_copy(src, dst, repeats, 1)
    return max(one, _best_copy(src, dst, repeats, threads)) if threads > 1 else one


def cpu_bandwidth(measure: bool = True) -> tuple[float, str]:
    """The cached measurement for this CPU class, measuring (≈1 s) and caching it when absent. A figure
    measured on a busy machine (other processes share the memory bus, so it reads low) is used until
    the machine is quiet, then measured again; an entry without that mark is measured again too."""
    path = cache_dir() / "hardware.json"
    key = cpu_class()
    try:
        cached = json.loads(read_trusted(path) or b"{}")  # one another user could have written is measured again
    except json.JSONDecodeError:
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    entry = cached.get(key)
    load = load_per_core()
    quiet = load <= BUSY_LOAD_PER_CORE
    if entry and entry.get("bandwidth_bytes_s", 0) > 0 and (entry.get("quiet") or not quiet or not measure):
        if entry.get("quiet"):
            return float(entry["bandwidth_bytes_s"]), "measured (cached)"
        busy = entry.get("load_per_core")
        return float(entry["bandwidth_bytes_s"]), ("measured (cached, on a busy machine"
                                                   + (f": load {busy:.1f} per core)" if busy is not None else ")"))
    if not measure:
        return table()["cpu"]["profiles"]["cpu-24gb"]["bandwidth_gbs"] * GB, "table (not measured)"
    bw = measure_copy_bandwidth()
    cached[key] = {"bandwidth_bytes_s": bw, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "load_per_core": round(load, 2), "quiet": quiet}
    write_private(path, json.dumps(cached, indent=2))
    return bw, "measured" if quiet else f"measured (on a busy machine: load {load:.1f} per core)"


def detect_cpu(measure: bool = True) -> HardwareProfile:
    import psutil

    vm = psutil.virtual_memory()
    bw, source = cpu_bandwidth(measure)
    return HardwareProfile(kind="cpu", name=cpu_name(), memory_bytes=vm.total, free_bytes=min(vm.available, vm.total),
                           bandwidth_bytes_s=bw, bandwidth_source=source, key=cpu_class(),
                           cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1)


def resolve_hardware(name: str | None, measure: bool = True) -> HardwareProfile:
    """``--hardware`` value → profile; None/'auto'/'here' → detect this machine."""
    if name is None or name.strip().lower() in ("", "auto", "here", "detect"):
        return detect(measure=measure)
    return named(name)
