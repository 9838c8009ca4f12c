"""One prompt-cache file: the safetensors format (8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw bytes), written and read here
with numpy so that a llama.cpp-only install needs no extra package; the files open with the
``safetensors`` library too.

What makes a file safe to load:
- it is written to a temporary name in the same folder (0600, in a 0700 folder), flushed and
  fsynced, then renamed (a kill mid-write leaves at most a ``*.tmp`` file, which nothing loads);
- it is this user's and no one else can write it or its folder (kvcache/private_files.py): any
  other file is refused before it is opened;
- the header's ``__metadata__`` holds the data's length and a SHA-256 of the header (all but the
  checksum) and the data, both checked before any tensor is handed out (a truncated file or a
  flipped byte anywhere is refused);
- the caller compares the metadata (model hash, backend, policy, layout) with what it expects.

Tensors come back as copy-on-write numpy arrays over a memory map of the file (nothing is copied
until the cache copies them into its own storage)."""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localctx.kvcache.private_files import private_writer, untrusted

FORMAT = "localctx-prompt-cache/1"
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "I64": np.int64, "I32": np.int32,
           "U8": np.uint8, "I8": np.int8, "U32": np.uint32}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items() if v is not None}
_HEADER_MAX = 64 << 20


class BadPromptFile(Exception):
    """The file cannot be used; the message says why in a few words."""


@dataclass
class PromptFile:
    metadata: dict[str, str]
    tensors: dict[str, np.ndarray]  # copy-on-write views over the memory map (the file never changes)
    path: Path


def write(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> int:
    """Writes atomically; returns the file's size in bytes."""
    header: dict = {}
    offset = 0
    arrays = []
    # widest element first: every tensor then starts aligned to its own element size
    for name, arr in sorted(tensors.items(), key=lambda item: -np.asarray(item[1]).dtype.itemsize):
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name}: dtype {arr.dtype} has no safetensors name here")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    header["__metadata__"] = dict(metadata, format=FORMAT, data_bytes=str(offset))
    digest = hashlib.sha256(_canonical(header))
    for arr in arrays:
        digest.update(memoryview(arr).cast("B"))
    header["__metadata__"]["sha256"] = digest.hexdigest()
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with private_writer(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(memoryview(arr).cast("B"))
    return 8 + len(blob) + offset


def _canonical(header: dict) -> bytes:
    """The header as the checksum sees it: everything but the checksum, keys sorted."""
    meta = {k: v for k, v in header["__metadata__"].items() if k != "sha256"}
    return json.dumps(dict(header, __metadata__=meta), sort_keys=True, separators=(",", ":")).encode()


def read_header(path: Path) -> tuple[dict, int]:
    """(header, data start) — raises BadPromptFile."""
    why = untrusted(path)
    if why:
        raise BadPromptFile(f"not safe to load: {why}")
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise BadPromptFile("shorter than a header")
            (n,) = struct.unpack("<Q", raw)
            if n > _HEADER_MAX:
                raise BadPromptFile("header length is implausible")
            blob = f.read(n)
    except OSError as exc:
        raise BadPromptFile(f"unreadable ({exc.strerror})") from None
    if len(blob) != n:
        raise BadPromptFile("truncated header")
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadPromptFile("the header is not valid JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise BadPromptFile("not a localctx prompt-cache file")
    return header, 8 + n


def read(path: Path, verify: bool = True) -> PromptFile:
    """Opens the file memory-mapped; with ``verify`` checks its length and checksum first."""
    header, start = read_header(path)
    meta = header.pop("__metadata__")
    try:
        data_bytes = int(meta["data_bytes"])
    except (KeyError, ValueError):
        raise BadPromptFile("the header has no data length") from None
    size = path.stat().st_size
    if size != start + data_bytes:
        raise BadPromptFile(f"{size - start:,} data bytes where the header says {data_bytes:,} (truncated?)")
    mm = np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=(data_bytes,)) if data_bytes else \
        np.zeros(0, np.uint8)
    if verify:
        digest = hashlib.sha256(_canonical(dict(header, __metadata__=meta)))
        digest.update(mm)
        if digest.hexdigest() != meta.get("sha256"):
            raise BadPromptFile("checksum mismatch (the file is corrupt)")
    tensors = {}
    for name, info in header.items():
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]])
            lo, hi = info["data_offsets"]
            shape = tuple(int(s) for s in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise BadPromptFile(f"tensor {name!r} is described wrongly") from None
        if not 0 <= lo <= hi <= data_bytes or (hi - lo) != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise BadPromptFile(f"tensor {name!r} does not fit the data section")
        tensors[name] = mm[lo:hi].view(dtype).reshape(shape)
    return PromptFile(meta, tensors, path)
