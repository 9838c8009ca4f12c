"""Calibrations: a backend's measured decode cost on one class of machine, per KV format.

A decode step of a model with a KV format on a machine costs about

    step_s(n) = base_s + s_per_kv_byte × kv_bytes(n)

where ``kv_bytes(n)`` is what attention reads after n tokens (the cost model's figure for that
format). Two timed context lengths per format give both numbers; with more, ``step_s`` follows
the measured points themselves and uses the line only past the longest. The per-byte cost differs by
format because dequantisation is work: on this project's 2-core CPU llama.cpp reads q4 KV
several times slower per byte than f16, so fewer bytes is not faster there.

Any backend can contribute one: time ``(context, kv bytes, seconds per step)`` points per format,
fit each with ``FormatCost.fit``, build a ``Calibration`` under the backend's name and the
``HardwareProfile.key`` of the machine, and ``save`` it. It is looked up by (backend, hardware key): first in
the user cache directory, then among the defaults committed in ``assets/calibration-*.json``.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from localctx.kvcache.hardware_profile import cache_dir
from localctx.kvcache.private_files import read_trusted, write_private

# a format's cost in the backend's default cache; "fp16-windowed": fp16 in the cache a windowed
# policy uses, where a backend's differs (torch keeps windowed keys before RoPE and rotates them per step)
FORMATS = ("fp16", "int8", "int4", "k8v4", "kf16v8", "kf16v4", "fp16-windowed")
WINDOWED = "-windowed"


@dataclass(frozen=True)
class FormatCost:
    """Decode cost of one KV format, fitted to measured (context tokens, kv bytes, seconds per step)."""
    base_s: float  # per-step time of the calibration model with an empty cache
    s_per_kv_byte: float  # extra time per byte of KV that attention reads
    points: tuple[tuple[int, int, float], ...] = ()  # (context tokens, kv bytes, seconds per step)
    settings: dict = field(default_factory=dict)  # backend settings measured, e.g. {"flash_attn": true}

    @classmethod
    def fit(cls, points: list[tuple[int, int, float]], settings: dict | None = None) -> "FormatCost":
        """Least-squares line through (kv bytes, step seconds); needs two distinct context lengths."""
        xs = [float(p[1]) for p in points]
        ys = [float(p[2]) for p in points]
        if len(set(xs)) < 2:
            raise ValueError("a calibration needs steps timed at two or more context lengths")
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 0.0)  # noise must not make longer contexts look faster
        return cls(base_s=max(my - slope * mx, 1e-6), s_per_kv_byte=slope,
                   points=tuple((int(c), int(b), float(s)) for c, b, s in points), settings=dict(settings or {}))

    def step_s(self, kv_bytes: int) -> float:
        """Seconds per step reading ``kv_bytes`` of KV. Through the measured points (their running
        maximum, so noise never makes more KV cheaper); flat below the smallest (a CPU's step is
        flat over the first few hundred tokens, which a straight line would overcharge); past the
        largest, on along the steeper of the last stretch and the fitted line. Without two
        measured points: the fitted line."""
        xs, ys = self._envelope
        if len(xs) < 2:
            return self.base_s + self.s_per_kv_byte * kv_bytes
        if kv_bytes <= xs[0]:
            return ys[0]
        if kv_bytes >= xs[-1]:  # the steeper of the last stretch and the fitted line: long contexts cost most
            last = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + max(last, self.s_per_kv_byte) * (kv_bytes - xs[-1])
        i = bisect.bisect_right(xs, kv_bytes)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (kv_bytes - x0) / (x1 - x0)

    @functools.cached_property  # the points never change: derive the envelope once
    def _envelope(self) -> tuple[list[float], list[float]]:
        by_bytes: dict[float, list[float]] = {}
        for _, b, s in self.points:
            by_bytes.setdefault(float(b), []).append(float(s))
        xs = sorted(by_bytes)
        ys = list(itertools.accumulate((statistics.median(by_bytes[x]) for x in xs), max))
        return xs, ys

    def to_dict(self) -> dict:
        return {"base_s": self.base_s, "s_per_kv_byte": self.s_per_kv_byte,
                "points": [list(p) for p in self.points], "settings": self.settings}

    @classmethod
    def from_dict(cls, d: dict) -> "FormatCost":
        return cls(base_s=float(d["base_s"]), s_per_kv_byte=float(d["s_per_kv_byte"]),
                   points=tuple(tuple(p) for p in d.get("points", ())), settings=dict(d.get("settings", {})))


@dataclass(frozen=True)
class Calibration:
    backend: str
    hardware_key: str
    model: str  # the model timed
    weight_bytes: int  # its weight bytes (what each step reads besides the KV)
    bandwidth_bytes_s: float  # the machine's measured bandwidth when calibrated
    formats: dict  # format name ("fp16", "int8", "int4") → FormatCost
    prefill_tok_s: float = 0.0  # measured prefill rate of the calibration model (0 = not measured)
    prefill_flops_s: float = 0.0  # the same as effective FLOP/s, to scale to other models
    threads: int = 0
    measured_at: str = ""
    note: str = ""
    source: str = ""  # where it was loaded from (set by ``load``)
    # a T-token verify step (prompt lookup: the pending token plus T - 1 drafted) in plain one-token
    # steps, T → cost, on the calibration model at 512 cached tokens; empty where not measured
    verify_step_cost: dict = field(default_factory=dict)

    def cost(self, fmt: str) -> FormatCost | None:
        return self.formats.get(fmt)

    def cost_for(self, fmt: str, windowed: bool) -> FormatCost | None:
        """The cost of a policy's format (its precision token: fp16, int8, k8v4, ...); a windowed
        policy's own cache cost where one was measured."""
        return (self.formats.get(fmt + WINDOWED) if windowed else None) or self.formats.get(fmt)

    def slowdown_vs_fp16(self, fmt: str, kv_tokens: int, bytes_per_token: dict[str, int]) -> float | None:
        """How much slower attention over ``kv_tokens`` tokens is in ``fmt`` than in fp16 (per step)."""
        a, b = self.cost(fmt), self.cost("fp16")
        if a is None or b is None:
            return None
        return a.step_s(bytes_per_token[fmt] * kv_tokens) / b.step_s(bytes_per_token["fp16"] * kv_tokens)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "hardware_key": self.hardware_key, "model": self.model,
                "weight_bytes": self.weight_bytes, "bandwidth_bytes_s": self.bandwidth_bytes_s,
                "formats": {k: v.to_dict() for k, v in self.formats.items()},
                "prefill_tok_s": self.prefill_tok_s, "prefill_flops_s": self.prefill_flops_s,
                "threads": self.threads, "measured_at": self.measured_at, "note": self.note,
                **({"verify_step_cost": {str(t): c for t, c in sorted(self.verify_step_cost.items())}}
                   if self.verify_step_cost else {})}

    @classmethod
    def from_dict(cls, d: dict, source: str = "") -> "Calibration":
        unknown = set(d["formats"]) - set(FORMATS)
        if unknown:
            raise ValueError(f"unknown KV formats in calibration: {sorted(unknown)}")
        return cls(backend=d["backend"], hardware_key=d["hardware_key"], model=d["model"],
                   weight_bytes=int(d["weight_bytes"]), bandwidth_bytes_s=float(d["bandwidth_bytes_s"]),
                   formats={k: FormatCost.from_dict(v) for k, v in d["formats"].items()},
                   prefill_tok_s=float(d.get("prefill_tok_s", 0.0)),
                   prefill_flops_s=float(d.get("prefill_flops_s", 0.0)), threads=int(d.get("threads", 0)),
                   measured_at=d.get("measured_at", ""), note=d.get("note", ""), source=source,
                   verify_step_cost=verify_costs(d.get("verify_step_cost", {})))


def verify_costs(raw: dict) -> dict[int, float]:
    """A calibration's verify step costs from JSON; a cost below one plain step or a length below 2 is damage."""
    out = {int(t): float(c) for t, c in raw.items()}
    if any(t < 2 or c < 1.0 for t, c in out.items()):
        raise ValueError(f"verify step costs must be for 2 or more tokens and at least 1 plain step: {raw}")
    return out


def file_name(backend: str, hardware_key: str) -> str:
    return f"calibration-{backend}-{hardware_key}.json"


def user_path(backend: str, hardware_key: str) -> Path:
    return cache_dir() / file_name(backend, hardware_key)


def save(cal: Calibration, path: Path | None = None) -> Path:
    """Atomically write a calibration to the user cache (or ``path``)."""
    path = path or user_path(cal.backend, cal.hardware_key)
    write_private(path, json.dumps(cal.to_dict(), indent=2) + "\n")
    return path


def load(backend: str, hardware_key: str) -> Calibration | None:
    """The user's own measurement if there is one (and it is trusted: kvcache/private_files.py), else
    the committed default, else None."""
    path = user_path(backend, hardware_key)
    raw = read_trusted(path)
    if raw is not None:
        try:
            return Calibration.from_dict(json.loads(raw), source=str(path))
        except (ValueError, KeyError, json.JSONDecodeError):
            pass  # a damaged cache file falls back to the default; `plan --calibrate` rewrites it
    asset = resources.files("localctx.assets").joinpath(file_name(backend, hardware_key))
    if asset.is_file():
        return Calibration.from_dict(json.loads(asset.read_text()), source=f"assets/{file_name(backend, hardware_key)}")
    return None


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def load_note() -> str:
    """How busy the machine was as a calibration ended (a busy machine times slow steps)."""
    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):  # no load average on this platform
        load = "unknown"
    return f"1-minute load average {load} on {os.cpu_count()} CPUs at the end"
