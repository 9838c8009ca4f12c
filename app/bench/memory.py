"""Peak memory of one measurement, inside the worker process that makes it.

On Linux the process's peak RSS (VmHWM) is reset before each measurement (/proc/self/clear_refs),
so the figure is that measurement's own peak; elsewhere it is the worker's peak so far. Where torch
has initialised CUDA, the device's peak allocation is reported too."""
from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass
class PeakMemory:
    rss_bytes: int
    scope: str  # "measurement" (reset before it) or "process" (peak since the worker started)
    device_bytes: int | None = None


def _vm_hwm() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cuda():
    torch = sys.modules.get("torch")  # only when the backend itself imported torch
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda
    return None


class PeakTracker:
    def __init__(self) -> None:
        self.scope = "process"

    def reset(self) -> None:
        try:
            _CLEAR_REFS.write_text("5")
            self.scope = "measurement"
        except OSError:
            self.scope = "process"
        cuda = _cuda()
        if cuda is not None:
            cuda.reset_peak_memory_stats()

    def read(self) -> PeakMemory:
        rss = _vm_hwm() if self.scope == "measurement" else None
        if rss is None:
            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            rss = maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux
        cuda = _cuda()
        return PeakMemory(rss_bytes=rss, scope=self.scope,
                          device_bytes=int(cuda.max_memory_allocated()) if cuda is not None else None)
