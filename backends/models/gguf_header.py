"""A fast GGUF header reader: metadata and tensor infos by plain struct reads, no tensor data.

The tokenizer's big arrays (tokens, merges, scores, token types; any array past ``KEEP_ITEMS``
items) are stepped over without building their strings: the header keeps where they start and
how many items they have, and ``GGUFHeader.get`` reads one from the file when someone asks for it.
Every length is checked against the file size, so a truncated or corrupt file ends in a one-line
UserError, never a traceback or an endless loop. Layout: the GGUF spec in ggml's docs/gguf.md."""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from localctx.kvcache.errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
# arrays read on demand only: the vocabulary-sized ones, and anything longer than KEEP_ITEMS
BIG_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                        "tokenizer.ggml.token_type"})
KEEP_ITEMS = 4096

# GGUF value types → struct format (one item); STRING = 8 and ARRAY = 9 are read by hand
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR_FORMATS = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f",
                  BOOL: "?", UINT64: "Q", INT64: "q", FLOAT64: "d"}


class Corrupt(Exception):
    """A length or type in the file that cannot be right (turned into a UserError by the caller)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the row length first
    ggml_type: int
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute file offset of the tensor's first byte


@dataclass(frozen=True)
class ArrayRef:
    """An array left in the file: its item type, item count and the offset of its first item."""
    item_type: int
    count: int
    offset: int


class _Cursor:
    """Reads little- or big-endian GGUF values from a buffer, bounds-checked against its length."""

    def __init__(self, buf, pos: int = 0, endian: str = "<"):
        self.buf, self.pos, self.end, self.endian = buf, pos, len(buf), endian
        self._u64 = struct.Struct(endian + "Q")
        self._formats = {t: struct.Struct(endian + f) for t, f in SCALAR_FORMATS.items()}

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise Corrupt(f"a field at byte {self.pos:,} runs {n:,} bytes past the end of the file")

    def scalar(self, vtype: int):
        fmt = self._formats[vtype]
        self.need(fmt.size)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def u32(self) -> int:
        return self.scalar(UINT32)

    def u64(self) -> int:
        return self.scalar(UINT64)

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Step over ``count`` strings reading only their lengths (the vocabulary: 50K–260K of them)."""
        unpack, buf, pos, end = self._u64.unpack_from, self.buf, self.pos, self.end
        for _ in range(count):
            if pos + 8 > end:
                break
            pos += 8 + unpack(buf, pos)[0]
        else:
            if pos <= end:
                self.pos = pos
                return
        raise Corrupt(f"an array of {count:,} strings runs past the end of the file")

    def value_type(self) -> int:
        vtype = self.u32()
        if vtype not in SCALAR_FORMATS and vtype not in (STRING, ARRAY):
            raise Corrupt(f"unknown value type {vtype} at byte {self.pos - 4:,}")
        return vtype

    def value(self, vtype: int):
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            item_type, count = self.value_type(), self.u64()
            return self.items(item_type, count)
        return self.scalar(vtype)

    def items(self, item_type: int, count: int) -> list:
        if item_type in SCALAR_FORMATS:
            size = self._formats[item_type].size
            self.need(count * size)
            fmt = struct.Struct(f"{self.endian}{count}{SCALAR_FORMATS[item_type]}")
            out = list(fmt.unpack_from(self.buf, self.pos))
            self.pos += count * size
            return out
        if count > self.end - self.pos:  # every string or array item takes at least one byte
            raise Corrupt(f"an array of {count:,} items is longer than the rest of the file")
        return [self.value(item_type) for _ in range(count)]

    def skip_items(self, item_type: int, count: int) -> None:
        if item_type in SCALAR_FORMATS:
            self.need(count * self._formats[item_type].size)
            self.pos += count * self._formats[item_type].size
        elif item_type == STRING:
            self.skip_strings(count)
        else:
            self.items(item_type, count)


class GGUFHeader:
    """Metadata values by key, big arrays as ArrayRefs read on demand, and the tensor infos."""

    def __init__(self, path: Path, file_size: int, version: int, alignment: int, data_start: int,
                 values: dict, arrays: dict[str, ArrayRef], tensors: list[TensorInfo], endian: str = "<"):
        self.path, self.file_size, self.version = Path(path), file_size, version
        self.alignment, self.data_start, self.endian = alignment, data_start, endian
        self.values, self.arrays, self.tensors = values, arrays, tensors

    def __contains__(self, key: str) -> bool:
        return key in self.values or key in self.arrays

    def keys(self) -> list[str]:
        return list(self.values) + list(self.arrays)

    def get(self, key: str, default=None):
        """The value of ``key`` (a big array is read from the file now), or ``default``."""
        if key in self.values:
            return self.values[key]
        ref = self.arrays.get(key)
        return default if ref is None else self.read_array(ref)

    def array_length(self, key: str) -> int | None:
        """Items in the array ``key`` without reading it (e.g. the vocabulary size), or None."""
        if key in self.arrays:
            return self.arrays[key].count
        value = self.values.get(key)
        return len(value) if isinstance(value, list) else None

    def read_array(self, ref: ArrayRef) -> list:
        def read(cur: _Cursor) -> list:
            return cur.items(ref.item_type, ref.count)
        return _with_file(self.path, read, ref.offset, self.endian)

    # -- the spec cache stores headers as JSON ----------------------------------------------------
    def to_json(self) -> dict:
        return {"version": self.version, "file_size": self.file_size, "alignment": self.alignment,
                "data_start": self.data_start, "endian": self.endian, "values": self.values,
                "arrays": {k: [a.item_type, a.count, a.offset] for k, a in self.arrays.items()},
                "tensors": [[t.name, list(t.shape), t.ggml_type, t.n_elements, t.n_bytes, t.data_offset]
                            for t in self.tensors]}

    @classmethod
    def from_json(cls, path: Path, data: dict) -> "GGUFHeader":
        return cls(path, int(data["file_size"]), int(data["version"]), int(data["alignment"]),
                   int(data["data_start"]), dict(data["values"]),
                   {k: ArrayRef(*map(int, a)) for k, a in data["arrays"].items()},
                   [TensorInfo(n, tuple(s), int(g), int(e), int(b), int(o)) for n, s, g, e, b, o in data["tensors"]],
                   endian=str(data["endian"]))


def corrupt_error(path: Path, why: str) -> UserError:
    return UserError(f"{path} is truncated or corrupt ({why}); download it again")


def _with_file(path: Path, parse, pos: int = 0, endian: str = "<"):
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise Corrupt("the file is empty")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return parse(_Cursor(buf, pos, endian))
    except Corrupt as exc:
        raise corrupt_error(path, str(exc)) from None
    except OSError as exc:
        raise UserError(f"cannot read model file {path}: {exc.strerror or exc}; check that it exists and "
                        "is readable") from None


def read_header(path: Path | str) -> GGUFHeader:
    """Parse ``path``'s header; big arrays are stepped over (see BIG_ARRAYS / KEEP_ITEMS)."""
    path = Path(path)
    return _with_file(path, lambda cur: _parse(path, cur))


def _parse(path: Path, cur: _Cursor) -> GGUFHeader:
    cur.need(4)
    if cur.buf[0:4] != MAGIC:
        raise UserError(f"{path} is not a GGUF file (it does not start with 'GGUF'); give a .gguf model")
    cur.pos = 4
    version = cur.u32()
    if version & 0xFFFF == 0:  # written on a big-endian host
        cur = _Cursor(cur.buf, 4, ">")
        version = cur.u32()
    if version not in VERSIONS:
        raise UserError(f"{path} is GGUF version {version}; localctx reads versions 2 and 3 "
                        "(convert it again with a current llama.cpp)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    values: dict = {}
    arrays: dict[str, ArrayRef] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.value_type()
        if vtype != ARRAY:
            values[key] = cur.value(vtype)
            continue
        item_type, count = cur.value_type(), cur.u64()
        if key in BIG_ARRAYS or count > KEEP_ITEMS:
            arrays[key] = ArrayRef(item_type, count, cur.pos)
            cur.skip_items(item_type, count)
        else:
            values[key] = cur.items(item_type, count)
    alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise Corrupt(f"general.alignment {alignment!r} is not a power of two")
    infos = [_tensor_info(cur) for _ in range(min(n_tensors, cur.end))]
    if len(infos) != n_tensors:
        raise Corrupt(f"it claims {n_tensors:,} tensors")
    if len({name for name, *_ in infos}) != len(infos):
        raise Corrupt("two tensors share a name")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [_sized(path, name, shape, gtype, data_start + offset) for name, shape, gtype, offset in infos]
    for t in tensors:
        if t.data_offset + t.n_bytes > cur.end:
            raise Corrupt(f"tensor {t.name} ends at byte {t.data_offset + t.n_bytes:,} of a "
                          f"{cur.end:,}-byte file")
    return GGUFHeader(path, cur.end, version, alignment, data_start, values, arrays, tensors, cur.endian)


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.u32()
    if n_dims > GGML_MAX_DIMS:
        raise Corrupt(f"tensor {name!r} has {n_dims} dimensions")
    shape = tuple(cur.u64() for _ in range(n_dims))
    return name, shape, cur.u32(), cur.u64()


def _sized(path: Path, name: str, shape: tuple[int, ...], ggml_type: int, data_offset: int) -> TensorInfo:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise UserError(f"{path.name}: tensor {name} has ggml type {ggml_type}, which the installed gguf "
                        "package does not know; upgrade it (pip install -U gguf) or check the file") from None
    n_elements = 1
    for d in shape:
        n_elements *= d
    row = shape[0] if shape else 1
    if row % block:
        raise Corrupt(f"tensor {name}'s rows of {row} elements are not whole {block}-element blocks")
    return TensorInfo(name, shape, ggml_type, n_elements, n_elements // block * type_size, data_offset)


_PLAIN_TYPES = {0: "float32", 1: "float16"}  # ggml F32, F16: stored as is


def tensor_data(weights, tensor: TensorInfo):
    """A tensor's stored bytes (``weights``: the file as a uint8 numpy memmap) as the gguf package's
    dequantiser takes them: F32/F16 as their dtype in [rows, cols], block-quantised types as uint8
    [rows, bytes per row]; a view of the memory map."""
    raw = weights[tensor.data_offset:tensor.data_offset + tensor.n_bytes]
    dims = tuple(reversed(tensor.shape))
    plain = _PLAIN_TYPES.get(tensor.ggml_type)
    if plain is not None:
        return raw.view(plain).reshape(dims)
    rows = tensor.n_elements // tensor.shape[0] if tensor.shape else 1
    return raw.reshape(*dims[:-1], tensor.n_bytes // max(rows, 1))


def dequantize_f32(weights, tensor: TensorInfo):
    """One GGUF tensor as a writable float32 numpy array in [rows, cols] (GGUF lists dims innermost
    first); a type the gguf package cannot dequantise is a one-line error."""
    import numpy as np
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    qtype = GGMLQuantizationType(tensor.ggml_type)
    try:
        data = quants.dequantize(tensor_data(weights, tensor), qtype)
    except NotImplementedError:
        raise UserError(f"tensor {tensor.name} is stored as {qtype.name}, which the gguf package "
                        "cannot dequantise; use --backend llamacpp for this file") from None
    data = np.ascontiguousarray(data, dtype=np.float32).reshape(tuple(reversed(tensor.shape)))
    return data if data.flags.writeable else data.copy()  # F32 tensors come back as read-only views
