"""HardwareProfile: what the planner knows about a machine (detected, or a named profile on paper).

Detection lives in ``localctx.backends.machine.detect``; this is only the type the planner consumes."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

GB = 1_000_000_000
MiB = 1024 ** 2
GiB = 1024 ** 3
CACHE_ENV = "LOCALCTX_CACHE_DIR"


def cache_dir() -> Path:
    """The user cache directory for measurements (LOCALCTX_CACHE_DIR overrides it, e.g. in tests)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localctx"))


@dataclass(frozen=True)
class HardwareProfile:
    kind: str  # "apple" | "cuda" | "cpu"
    name: str  # e.g. "Apple M2 Max", "NVIDIA GeForce RTX 4090", "Intel(R) Xeon(R) Processor"
    memory_bytes: int  # capacity the model can live in: unified memory, VRAM, or RAM
    free_bytes: int  # what is free for weights + KV + runtime now (or, on paper, what a user typically has)
    bandwidth_bytes_s: float  # achievable memory bandwidth
    bandwidth_source: str  # "measured", "table", "nvml", or "profile"
    key: str = ""  # the class calibrations are keyed by: a named profile, a GPU name, or a CPU class
    cores: int = 0
    compute_flops: float = 0.0  # peak fp16 FLOP/s where known (prefill estimate); 0 = unknown
    detected: bool = True  # False for a named profile planned on paper
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("apple", "cuda", "cpu"):
            raise ValueError(f"hardware kind must be apple, cuda or cpu, not {self.kind!r}")
        if self.memory_bytes <= 0 or self.bandwidth_bytes_s <= 0:
            raise ValueError("hardware memory and bandwidth must be positive")
        if not 0 <= self.free_bytes <= self.memory_bytes:
            raise ValueError("free memory must be between 0 and the total")

    def describe(self) -> str:
        where = "detected" if self.detected else "named profile"
        return (f"{self.name} ({self.kind}, {where}): {self.memory_bytes / GiB:.0f} GiB, "
                f"{self.free_bytes / GiB:.1f} GiB free, {self.bandwidth_bytes_s / GB:.0f} GB/s "
                f"({self.bandwidth_source})")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "HardwareProfile":
        names = cls.__dataclass_fields__.keys()
        kw = {k: v for k, v in data.items() if k in names}
        kw["notes"] = tuple(kw.get("notes", ()))
        return cls(**kw)
