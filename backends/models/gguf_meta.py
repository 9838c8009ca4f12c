"""A model GGUF's metadata as the readers and model pages take it: keys under the architecture's
prefix (``get("block_count")`` reads ``<arch>.block_count``), with a default or required (a missing
one is a one-line UserError naming the key), and the few values every reader derives the same way.

It reads a parsed header (gguf_header.GGUFHeader, as spec_reader.read_gguf returns it from the
header cache): nothing here opens the file, except for a big array a caller asks for by name."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.backends.models.gguf_header import GGUFHeader
from localctx.kvcache.errors import UserError


@dataclass(frozen=True)
class ModelMeta:
    header: GGUFHeader
    file_name: str  # how errors name the file

    @property
    def arch(self) -> str | None:
        """``general.architecture``; None in a GGUF that is not a model (callers say so)."""
        return self.header.get("general.architecture")

    def get(self, key: str, default=None):
        """``<arch>.<key>``, or ``default`` where the file does not have it."""
        return self.header.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        """``<arch>.<key>``; a file without it is a one-line UserError."""
        value = self.get(key)
        if value is None:
            raise UserError(f"{self.file_name} lacks {self.arch}.{key} in its metadata; the file is incomplete")
        return value

    def vocab_size(self) -> int:
        """``<arch>.vocab_size``, else the length of the vocabulary (without reading it); 0 if neither."""
        return int(self.get("vocab_size", self.header.array_length("tokenizer.ggml.tokens") or 0))

    def linear_rope(self, engine: str) -> float | None:
        """The factor of the file's linear RoPE scaling, None where it has none; any other kind is a
        one-line UserError saying that ``engine`` (e.g. "the torch backend") does not run it."""
        kind = str(self.get("rope.scaling.type", "none"))
        if kind in ("none", ""):
            return None
        if kind == "linear":
            return float(self.get("rope.scaling.factor", 1.0))
        raise UserError(f"{self.file_name} uses RoPE scaling {kind!r}, which {engine} does not run; "
                        "use --backend llamacpp for this model")
