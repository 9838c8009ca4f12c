"""A GGUF tensor's own quantization grid, handed to MLX as is.

MLX's affine quantization stores, per group of ``group_size`` values, ``value = scale * q + bias`` with
an unsigned ``bits``-bit q. Several GGUF types are already exactly that with groups of 32: Q4_0
(``d * (q - 8)``), Q5_0 (``d * (q - 16)``), Q4_1 and Q5_1 (``d * q + m``), Q8_0 (``d * q`` with a signed
q, i.e. ``d * (u - 128)``), Q4_K and Q5_K (per 32-value sub-block ``d * sc * q - dmin * m``). For those the
converted layer keeps the file's values: scales and biases are read from the blocks and each q is
recovered from the dequantized value. (The layer holds its scales and biases in float16: exact for the
legacy types' own float16 ``d`` and ``m``; a K-quant's ``d * sc`` is rounded there, by at most 2**-11 of it.)
Re-quantizing them with ``mx.quantize`` instead chooses another grid and rounds every value a second
time: on the bundled SmolLM2 (Q4_1) that moved each weight by 7.7% on average and the model's logits to
a correlation of 0.80-0.95 with llama.cpp's (it answered "A: A: A:" where llama.cpp names a colour).
Other types (Q6_K's, Q2_K's and Q3_K's 16-value groups, the IQ types' lookup tables) fit no grid of
MLX's (its groups are 32, 64 or 128 values) and are kept in float16: their values, not a rounding of them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32


@dataclass(frozen=True)
class Grid:
    """A tensor in MLX's packed affine layout: ``weight`` uint32 [rows, cols * bits / 32], ``scales`` and
    ``biases`` float32 [rows, cols / 32]."""
    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def group_affine(qtype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(scale, bias) of each 32-value group, in file order, and the bits of q, for the types whose
    values are ``scale * q + bias`` with q in [0, 2**bits); None for the others. ``blocks``: the
    tensor's raw bytes as [n_blocks, bytes per block]."""
    if qtype == "Q4_0":
        d = _f16(blocks, 0)
        return d, -8.0 * d, 4
    if qtype == "Q4_1":
        return _f16(blocks, 0), _f16(blocks, 2), 4
    if qtype == "Q5_0":
        d = _f16(blocks, 0)
        return d, -16.0 * d, 5
    if qtype == "Q5_1":
        return _f16(blocks, 0), _f16(blocks, 2), 5
    if qtype == "Q8_0":
        d = _f16(blocks, 0)
        return d, -128.0 * d, 8
    if qtype in ("Q4_K", "Q5_K"):  # the same header: d, dmin, then 6-bit scales and mins of 8 sub-blocks
        from gguf.quants import Q4_K

        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:4 + Q4_K.K_SCALE_SIZE].copy())
        scales = (d[:, None] * sc.astype(np.float32)).ravel()
        return scales, (-dmin[:, None] * mn.astype(np.float32)).ravel(), 4 if qtype == "Q4_K" else 5
    return None


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[rows, cols] integers in [0, 2**bits) into MLX's layout: each row one little-endian bit stream,
    value j in bits [bits * j, bits * (j + 1)), read as uint32 words (for 4 and 8 bits: 32 / bits
    consecutive values a word, the first in the lowest bits). ``cols``: a multiple of 32."""
    rows = q.shape[0]
    eight = q.astype(np.uint64).reshape(rows, -1, 8)  # 8 values fill ``bits`` whole bytes
    acc = np.zeros(eight.shape[:2], dtype=np.uint64)
    for j in range(8):
        acc |= eight[:, :, j] << np.uint64(bits * j)
    stream = acc.astype("<u8").view(np.uint8).reshape(rows, -1, 8)[:, :, :bits]
    return np.ascontiguousarray(stream).reshape(rows, -1).view("<u4").astype(np.uint32)


def exact_grid(qtype: str, blocks: np.ndarray, values: np.ndarray) -> Grid | None:
    """``values`` (the tensor dequantized, float32 [rows, cols]) in MLX's affine layout on the file's
    own grid, or None where the type has none MLX holds or a value falls off it (then the caller keeps
    the values in float16)."""
    found = group_affine(qtype, blocks)
    rows, cols = values.shape
    if found is None or cols % GROUP:
        return None
    scales, biases, bits = found
    scales, biases = scales.reshape(rows, cols // GROUP), biases.reshape(rows, cols // GROUP)
    grouped = values.reshape(rows, cols // GROUP, GROUP)
    safe = np.where(scales == 0, 1.0, scales)[..., None]
    q = np.where(scales[..., None] == 0, 0.0, np.rint((grouped - biases[..., None]) / safe))
    rebuilt = q * scales[..., None] + biases[..., None]
    if q.min() < 0 or q.max() >= 2 ** bits or not np.allclose(rebuilt, grouped, rtol=1e-5, atol=1e-7):
        return None
    return Grid(pack(q.reshape(rows, cols), bits), scales.astype(np.float32), biases.astype(np.float32), bits)
