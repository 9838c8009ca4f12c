"""One model's measured KV quality on one backend (``localctx plan --calibrate-quality``), cached per
model file identity and backend (docs/quality.md "KL divergence").

The identity is the file's size, modification time and the SHA-256 of its first MiB (a GGUF's header
and the start of its tensors; a folder: its config.json). The cache file is written atomically and
owner-only (kvcache/private_files.py). A file that is damaged, untrusted, or made for another file
identity or backend is never used: ``load`` returns None with a one-line note saying why.

Version 2 adds ``windows``: the sliding window the planner would use on the machine, measured with the
longest window the text allows and scored only at the positions past it (policy text → figures and
``score_from``, the first scored position); a version 1 file is ignored with a note to rerun."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import cache_dir
from localctx.kvcache.kld_quality import KldFigure, window_key
from localctx.kvcache.private_files import read_trusted, untrusted, write_private
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.quality import format_key

VERSION = 2
HEAD_BYTES = 1 << 20


def identity(model_file: Path) -> dict:
    """size, mtime and the first MiB's SHA-256 of the model file (a folder: of its config.json)."""
    path = Path(model_file)
    if path.is_dir():
        path = path / "config.json"
    st = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
    return {"file": str(Path(model_file).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "head_sha256": head}


def cache_path(model_file: Path, backend: str) -> Path:
    ident = identity(model_file)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "quality" / f"{backend}-{Path(model_file).name}-{digest}.json"


@dataclass(frozen=True)
class QualityCalibration:
    backend: str
    model: dict  # identity()
    figures: dict  # format → {"mean_kld", "p99_kld", "top1", "ppl_delta_pct", "tokens"}
    command: str = ""
    measured_at: str = ""
    note: str = ""  # host load and wall time
    extra: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)  # "fp16+sink4+win1536" → figures + "score_from"

    def to_dict(self) -> dict:
        return {"version": VERSION, "backend": self.backend, "model": self.model, "figures": self.figures,
                "windows": self.windows, "command": self.command, "measured_at": self.measured_at,
                "note": self.note, **self.extra}

    def kld_figures(self, source: str) -> dict[str, KldFigure]:
        return {fmt: KldFigure(fmt, float(f["mean_kld"]), float(f["p99_kld"]), float(f["top1"]), "measured",
                               source, int(f.get("tokens", 0))) for fmt, f in self.figures.items()}

    def window_figures(self, source: str) -> dict[str, KldFigure]:
        """window_key ('fp16+sink4') → the measured window's figure, its window length beside."""
        out = {}
        for text, f in self.windows.items():
            policy = KVPolicy.parse(text)
            out[window_key(policy)] = KldFigure(text, float(f["mean_kld"]), float(f["p99_kld"]), float(f["top1"]),
                                                "measured", source, int(f["tokens"]), window=policy.window)
        return out


def save(cal: QualityCalibration, model_file: Path) -> Path:
    path = cache_path(model_file, cal.backend)
    write_private(path, json.dumps(cal.to_dict(), indent=2) + "\n")
    return path


class OldVersion(ValueError):
    pass


def _numbers(f: dict) -> dict:
    return {k: float(f[k]) for k in ("mean_kld", "p99_kld", "top1")} | {
        "ppl_delta_pct": float(f.get("ppl_delta_pct", 0.0)), "tokens": int(f.get("tokens", 0))}


def _parse(data: dict) -> QualityCalibration:
    if data.get("version") != VERSION:
        raise OldVersion(f"version {data.get('version')!r}, not {VERSION}")
    figures = {}
    for fmt, f in data["figures"].items():
        if fmt != format_key(KVPolicy.parse(fmt)) or not KVPolicy.parse(fmt).quantized:
            raise ValueError(f"{fmt!r} is not a quantized format without a window")
        figures[fmt] = _numbers(f)
    windows = {}
    for text, f in data["windows"].items():
        policy = KVPolicy.parse(text)
        if str(policy) != text or not policy.evicts or policy.heavy:
            raise ValueError(f"{text!r} is not a sinks + window policy")
        if int(f["score_from"]) <= policy.capacity() or int(f["tokens"]) < 1:
            raise ValueError(f"{text!r} was not scored past its window")
        windows[text] = _numbers(f) | {"score_from": int(f["score_from"])}
    return QualityCalibration(str(data["backend"]), dict(data["model"]), figures, str(data.get("command", "")),
                              str(data.get("measured_at", "")), str(data.get("note", "")), windows=windows)


def load(model_file: Path, backend: str) -> tuple[QualityCalibration | None, str]:
    """This model file's calibration on ``backend`` and its path, or None and a one-line note ("" when
    there is simply none)."""
    try:
        path = cache_path(model_file, backend)
    except OSError:
        return None, ""
    if not path.exists():
        return None, ""
    why = untrusted(path)
    raw = read_trusted(path) if why is None else None
    if raw is None:
        return None, f"note: quality calibration {path} ignored ({why or 'unreadable'}); rerun --calibrate-quality"
    try:
        cal = _parse(json.loads(raw))
    except OldVersion:
        return None, (f"note: quality calibration {path} ignored (made by an older localctx, without windows); "
                      "rerun localctx plan --calibrate-quality")
    except (ValueError, KeyError, TypeError, AttributeError, UserError) as exc:
        return None, (f"note: quality calibration {path} ignored (damaged: {type(exc).__name__}); "
                      "rerun localctx plan --calibrate-quality")
    if cal.backend != backend or cal.model != identity(model_file):
        return None, (f"note: quality calibration {path} ignored (made for another model file or backend); "
                      "rerun localctx plan --calibrate-quality")
    return cal, str(path)


def offer_once(model_file: Path, backend: str) -> bool:
    """True the first time it is asked for this model file and backend (a marker file remembers it)."""
    try:
        path = cache_path(model_file, backend).with_suffix(".offered")
        if path.exists():
            return False
        write_private(path, "offered --calibrate-quality once\n")
    except OSError:
        return False
    return True
