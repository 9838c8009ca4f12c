"""The machine a bench ran on, for the report (the bandwidth comes from the planner's detection)."""
from __future__ import annotations

import os
import platform

from localctx.backends.machine.detect import cpu_name


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
