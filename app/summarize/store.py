"""What survives a crash: summaries written atomically, a manifest of finished documents, and a
cache of every generation (chunk summaries, partial reductions) keyed by its exact request.

Everything lives under --out: ``<key>.summary.md`` beside the mirrored tree, and
``.localctx-summarize/{manifest.json,cache/}``. A kill -9 at any moment leaves at worst a stray
temp file (removed on the next run) and loses only the generations in flight."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from localctx.kvcache.errors import UserError

META_DIR = ".localctx-summarize"
TMP_PREFIX = ".lcx-tmp-"
SUMMARY_SUFFIX = ".summary.md"
REPORT_NAME = "summarize-report.json"


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def request_key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


class Store:
    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.meta_dir = out_dir / META_DIR
        self.cache_dir = self.meta_dir / "cache"
        self.manifest_path = self.meta_dir / "manifest.json"
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create the output folder {out_dir}: {exc.strerror or exc}; "
                            "choose a writable --out") from None
        self._remove_stray_temps()
        self.manifest = self._load_manifest()

    def _remove_stray_temps(self) -> None:
        for dirpath, _dirs, files in os.walk(self.out_dir):
            for name in files:
                if name.startswith(TMP_PREFIX):
                    try:
                        os.remove(os.path.join(dirpath, name))
                    except OSError:
                        pass

    def _load_manifest(self) -> dict:
        try:
            data = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {"documents": {}}
        except (OSError, ValueError):
            return {"documents": {}}  # unreadable: redo the work rather than trust it
        return data if isinstance(data.get("documents"), dict) else {"documents": {}}

    # -- documents ---------------------------------------------------------------
    def summary_path(self, key: str) -> Path:
        return self.out_dir / (key + SUMMARY_SUFFIX)

    def is_done(self, key: str, fingerprint: dict) -> bool:
        entry = self.manifest["documents"].get(key)
        return bool(entry) and entry.get("fingerprint") == fingerprint and self.summary_path(key).is_file()

    def finish(self, key: str, fingerprint: dict, summary: str, record: dict) -> Path:
        path = self.summary_path(key)
        atomic_write(path, summary.rstrip() + "\n")
        self.manifest["documents"][key] = {"fingerprint": fingerprint, "output": str(path.relative_to(self.out_dir)),
                                           **record}
        atomic_write(self.manifest_path, json.dumps(self.manifest, indent=1, sort_keys=True))
        return path

    # -- generation cache ------------------------------------------------------------
    def _cache_file(self, key: str) -> Path:
        return self.cache_dir / key[:2] / f"{key}.json"

    def cached(self, key: str) -> dict | None:
        try:
            data = json.loads(self._cache_file(key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data.get("text"), str) else None

    def remember(self, key: str, result: dict) -> None:
        atomic_write(self._cache_file(key), json.dumps(result, ensure_ascii=False))
