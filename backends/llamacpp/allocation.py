"""What llama.cpp allocates for a model's KV cache, to the byte, without loading it.

The rules, from llama.cpp's sources (the version llama-cpp-python vendors):
- ``src/llama-context.cpp``: the context is padded, ``n_ctx = GGML_PAD(n_ctx, 256)``.
- ``src/llama-kv-cache.cpp``: each layer that holds KV gets a K tensor of ``n_embd_k_gqa(il)`` × cells
  and a V tensor of ``n_embd_v_gqa(il)`` × cells in the cache's ggml types; without flash attention V
  is stored transposed and every layer's V row is ``n_embd_v_gqa_max()`` wide.
- ``src/llama-kv-cache-iswa.cpp``: a model with sliding layers has two caches. The non-SWA one has
  ``n_ctx`` cells; the SWA one ``GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256)`` cells, or ``n_ctx``
  cells with ``swa_full`` ("using full-size SWA cache"), which is llama.cpp's default.
- A compact SWA cache cannot shift (``get_can_shift`` needs both caches the same size), so sinks +
  window plans, which stream through a context shift, run with ``swa_full``.
Row bytes follow ggml's block layouts (ggml-common.h): f16 2 bytes an element; q8_0 34 bytes and
q4_0 18 bytes per block of 32."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.kvcache.model_spec import SLIDING, ModelSpec

CELL_PAD = 256
N_UBATCH = 512  # llama-cpp-python's default n_ubatch, which localctx keeps
GGML_BLOCKS = {"f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}  # type → (elements, bytes) per block


def pad(n: int, to: int = CELL_PAD) -> int:
    return -(-n // to) * to


def row_bytes(type_name: str, n_elements: int) -> int:
    """ggml_row_size: bytes of ``n_elements`` of a ggml type."""
    elems, size = GGML_BLOCKS[type_name]
    return n_elements // elems * size


def swa_window(spec: ModelSpec) -> int | None:
    """llama.cpp's single ``n_swa`` for the model's sliding layers (None without any)."""
    windows = {layer.window for layer in spec.attention() if layer.kind == SLIDING and layer.holds_kv}
    return max(windows) if windows else None


def swa_cells_held(pos_min: int, reused: int, n_swa: int) -> bool:
    """Whether a compact SWA cache whose oldest sliding-layer cell of a sequence is at ``pos_min`` still holds
    the window a prompt going on after its first ``reused`` tokens attends to: llama.cpp drops a sequence's
    cells older than the window plus a batch as it goes on (a session's and a server slot's prefix reuse)."""
    return pos_min <= max(0, reused - n_swa)


@dataclass(frozen=True)
class CacheAlloc:
    """One llama.cpp KV cache: its cells, the layers in it, and the bytes of its K and V tensors."""
    name: str  # "kv" (one cache), "non-SWA" or "SWA"
    cells: int
    layers: int
    k_bytes: int
    v_bytes: int

    @property
    def bytes(self) -> int:
        return self.k_bytes + self.v_bytes


@dataclass(frozen=True)
class LlamaCppCache:
    """The settings that size llama.cpp's KV cache."""
    n_ctx: int
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    swa_full: bool = True
    n_ubatch: int = N_UBATCH

    def caches(self, spec: ModelSpec) -> list[CacheAlloc]:
        layers = [layer for layer in spec.attention() if layer.holds_kv]
        n_ctx = pad(self.n_ctx)
        v_max = max((layer.v_width for layer in layers), default=0)

        def alloc(name: str, group, cells: int) -> CacheAlloc:
            k = sum(row_bytes(self.type_k, layer.k_width) for layer in group) * cells
            v = sum(row_bytes(self.type_v, layer.v_width if self.flash_attn else v_max) for layer in group) * cells
            return CacheAlloc(name, cells, len(group), k, v)

        n_swa = swa_window(spec)
        if n_swa is None:
            return [alloc("kv", layers, n_ctx)]
        sliding = [layer for layer in layers if layer.kind == SLIDING]
        full = [layer for layer in layers if layer.kind != SLIDING]
        swa_cells = n_ctx if self.swa_full else pad(min(n_ctx, n_swa + self.n_ubatch))
        return [alloc("non-SWA", full, n_ctx), alloc("SWA", sliding, swa_cells)]

    def bytes(self, spec: ModelSpec) -> int:
        return sum(c.bytes for c in self.caches(spec))


def held_bytes(spec: ModelSpec, type_k: str, type_v: str, in_cache: int) -> int:
    """KV bytes of the tokens llama.cpp holds: ``in_cache`` cells in full layers (the context after any
    shift), at most the window in sliding ones, in the cache's ggml types."""
    total = 0
    for layer, count in spec.layer_groups():
        if not layer.holds_kv:
            continue
        held = min(in_cache, layer.window) if layer.kind == SLIDING else in_cache
        total += count * held * (row_bytes(type_k, layer.k_width) + row_bytes(type_v, layer.v_width))
    return total
