"""Where a command's start-up time goes (``localctx run --timings``): seconds per stage, in order."""
from __future__ import annotations

import os
import time


def since_process_start() -> float | None:
    """Seconds since this process started (the interpreter, its imports and the command's until now);
    None where the start time cannot be read. On Linux both ends are read on the clock that counts from
    boot (the kernel's start time of the process in clock ticks, 10 ms): psutil's create_time adds the
    boot time, which /proc gives in whole seconds, so its answer could be off by up to a second."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start)
    except (OSError, AttributeError, ValueError, IndexError):  # no /proc (macOS, Windows)
        pass
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except (ImportError, OSError):  # pragma: no cover - psutil is a declared dependency
        return None


class Stopwatch:
    """``lap(name)`` closes the stage that ran since the last lap (or since the stopwatch started)."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = self.stages.get(name, 0.0) + now - self._last
        self._last = now

    def split(self, name: str, part: str, seconds: float) -> None:
        """Moves ``seconds`` of stage ``name`` into a stage of its own, ``part`` (a part the code behind
        the stage measured itself, e.g. the session's chat template inside the load)."""
        if name in self.stages and seconds > 0:
            self.stages[name] -= seconds
            self.stages[part] = self.stages.get(part, 0.0) + seconds

    def line(self) -> str:
        total = sum(self.stages.values())
        parts = ", ".join(f"{name} {seconds:.3f}" for name, seconds in self.stages.items())
        return f"[timings (s): {parts}; total {total:.3f}]"
