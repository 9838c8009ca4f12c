"""Find the documents to summarise and read them as text; bad files become ``Skipped`` records
(with the reason), never exceptions, so the batch goes on."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from localctx.app.summarize.html_text import html_to_text
from localctx.kvcache.errors import UserError

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".text"}
HTML_SUFFIXES = {".html", ".htm", ".xhtml"}
PDF_SUFFIXES = {".pdf"}
SUPPORTED = TEXT_SUFFIXES | HTML_SUFFIXES | PDF_SUFFIXES
_SNIFF = 8192


@dataclass(frozen=True)
class InputFile:
    path: Path  # where it is on disk
    key: str  # its name under --out (relative path with "/" separators)


@dataclass(frozen=True)
class Document:
    key: str
    path: Path
    text: str
    sha256: str  # of the file's bytes


@dataclass(frozen=True)
class Skipped:
    key: str
    path: Path
    reason: str
    ignored: bool = False  # an unsupported file found inside a folder: listed, not an error


def discover(paths: list[str], out_dir: Path) -> tuple[list[InputFile], list[Skipped]]:
    """Files named directly are taken whatever their suffix (and refused later if unsupported);
    folders are walked recursively for supported suffixes, skipping hidden entries and --out."""
    files: list[InputFile] = []
    ignored: list[Skipped] = []
    out_real = out_dir.resolve()
    for raw in paths:
        root = Path(os.path.expanduser(raw))
        if not root.exists():
            raise UserError(f"input not found: {raw}; give existing files or folders")
        if root.is_dir():
            files_here, ignored_here = _walk(root, out_real, prefix=root.resolve().name if len(paths) > 1 else "")
            files += files_here
            ignored += ignored_here
        else:
            files.append(InputFile(root, root.name))
    seen: dict[str, Path] = {}
    for f in files:
        if f.key in seen and seen[f.key].resolve() != f.path.resolve():
            raise UserError(f"{seen[f.key]} and {f.path} would both be summarised to {f.key}; "
                            "pass their common folder instead")
        seen[f.key] = f.path
    unique = list({f.key: f for f in files}.values())
    return sorted(unique, key=lambda f: f.key), ignored


def _walk(root: Path, out_real: Path, prefix: str) -> tuple[list[InputFile], list[Skipped]]:
    files, ignored = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames
                             if not d.startswith(".") and (here / d).resolve() != out_real)
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = here / name
            key = "/".join(filter(None, [prefix, path.relative_to(root).as_posix()]))
            if path.suffix.lower() in SUPPORTED:
                files.append(InputFile(path, key))
            else:
                ignored.append(Skipped(key, path, f"unsupported file type {path.suffix or '(none)'!r}", ignored=True))
    return files, ignored


def read(item: InputFile) -> Document | Skipped:
    try:
        data = item.path.read_bytes()
    except OSError as exc:
        return Skipped(item.key, item.path, f"unreadable: {exc.strerror or exc}")
    suffix = item.path.suffix.lower()
    if suffix not in SUPPORTED:
        return Skipped(item.key, item.path, f"unsupported file type {suffix or '(none)'!r}; "
                       f"supported: {', '.join(sorted(SUPPORTED))}")
    if not data.strip():
        return Skipped(item.key, item.path, "empty file")
    digest = hashlib.sha256(data).hexdigest()
    if suffix in PDF_SUFFIXES:
        text, problem = _pdf_text(item.path)
    else:
        text, problem = _decode(data)
        if text is not None and suffix in HTML_SUFFIXES:
            text = html_to_text(text)
    if problem:
        return Skipped(item.key, item.path, problem)
    if not text or not text.strip():
        return Skipped(item.key, item.path, "no text in it" + (" (a scanned PDF without a text layer?)"
                                                               if suffix in PDF_SUFFIXES else ""))
    return Document(item.key, item.path, text, digest)


def _decode(data: bytes) -> tuple[str | None, str | None]:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16"), None
        except UnicodeDecodeError as exc:
            return None, f"undecodable UTF-16 at byte {exc.start}; convert it to UTF-8"
    if b"\x00" in data[:_SNIFF]:
        return None, "binary file (NUL bytes); give text, markdown, HTML or PDF"
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        return None, (f"undecodable: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                      "convert it to UTF-8 (e.g. iconv -t utf-8)")


def _pdf_text(path: Path) -> tuple[str | None, str | None]:
    try:
        from pypdf import PdfReader
        from pypdf.errors import PdfReadError
    except ImportError:
        return None, "PDF needs the pypdf package: pip install 'localctx[pdf]'"
    try:
        reader = PdfReader(str(path))
        if reader.is_encrypted:
            return None, "encrypted PDF; decrypt it first (e.g. qpdf --decrypt)"
        pages = [(page.extract_text() or "").strip() for page in reader.pages]
    except (PdfReadError, OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"unreadable PDF: {exc}"
    return "\n\n".join(p for p in pages if p) + "\n", None
