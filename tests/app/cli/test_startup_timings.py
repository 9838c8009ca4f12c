"""`run --timings`' first stage, the time since the process started, read in the process itself."""
from __future__ import annotations

import subprocess
import sys
import time

PROBE = "from localctx.app.startup_timings import since_process_start; print(since_process_start())"


def test_time_since_process_start_fits_inside_the_process_wall_time():
    """It was read through psutil, whose start time adds a boot time /proc gives in whole seconds: on a
    host booted at x.75 s it said 0.75 s for a process that had run 0.05 s. Measured from outside, the
    child's whole life bounds it (plus the kernel's 10 ms start-time tick)."""
    for _ in range(3):
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
        seconds = float(out.stdout)
        assert 0.0 < seconds <= wall + 0.011, (seconds, wall)
