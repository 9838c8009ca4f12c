"""backends/mlx/gguf_grid.py: the GGUF types whose values lie on an MLX affine grid of 32 are handed to
MLX on that grid, value for value; the others are refused (the converter keeps them in float16). Checked
on every such tensor of the real bundled SmolLM2 (Q4_1, Q8_0), Gemma 3 270M (Q4_K, Q5_0, Q8_0; Q6_K
refused) and copies of SmolLM2 made by llama.cpp's own quantizer (Q4_0, Q5_1, Q5_K_M)."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from localctx.backends.mlx.gguf_grid import GROUP, exact_grid, pack  # noqa: E402
from localctx.backends.models.gguf_header import dequantize_f32, tensor_data  # noqa: E402
from localctx.backends.models.spec_reader import read_gguf  # noqa: E402

pytestmark = pytest.mark.slow
HELD = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}


def requantized(smollm2_path, tmp_path_factory, ftype: str):
    pytest.importorskip("llama_cpp", reason="llama.cpp's quantizer makes the copies")
    pytest.importorskip("mlx_lm", reason="the copies' helper lives beside the mlx-lm tests")
    from test_mlx_zoo_real import quantized_copy

    return quantized_copy(smollm2_path, tmp_path_factory.mktemp(ftype.lower()), ftype)


def grids_of(path):
    """(type name, grid or None, the tensor's values) of each 2-D block-quantized tensor."""
    reader = read_gguf(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.ggml_type)
        if len(t.shape) != 2 or qtype.name in ("F32", "F16", "BF16"):
            continue
        values = dequantize_f32(raw, t)
        blocks = np.asarray(tensor_data(raw, t)).reshape(-1, GGML_QUANT_SIZES[qtype][1])
        yield qtype.name, exact_grid(qtype.name, blocks, values), values


def check(path, want_types: set[str]) -> None:
    seen = set()
    for name, grid, values in grids_of(path):
        seen.add(name)
        if name not in HELD:
            assert grid is None, name  # no grid of MLX's holds it: kept in float16
            continue
        assert grid is not None and grid.bits == HELD[name], name
        back = mx.dequantize(mx.array(grid.weight), mx.array(grid.scales), mx.array(grid.biases), GROUP, grid.bits)
        assert np.allclose(np.array(back), values, rtol=1e-6, atol=1e-7), name  # the file's values, not a rounding
    assert want_types <= seen, seen


def test_bundled_smollm2_q4_1_and_q8_0_keep_their_values(smollm2_path):
    check(smollm2_path, {"Q4_1", "Q8_0"})


def test_gemma3_q4_k_and_q5_0_keep_their_values_and_q6_k_is_left_to_float16(gemma3_path):
    check(gemma3_path, {"Q4_K", "Q8_0", "Q5_0", "Q6_K"})


@pytest.mark.parametrize("ftype, types", [("Q4_0", {"Q4_0"}), ("Q5_1", {"Q5_1"}), ("Q5_K_M", {"Q5_K", "Q6_K"})])
def test_llama_cpp_quantizer_copies_keep_their_values(smollm2_path, tmp_path_factory, ftype, types):
    check(requantized(smollm2_path, tmp_path_factory, ftype), types)


def test_pack_puts_consecutive_values_low_bits_first():
    q = np.arange(16, dtype=np.uint32).reshape(1, 16) % 16
    assert pack(q, 4).tolist() == [[0x76543210, 0xFEDCBA98]]
    assert pack(np.array([[1, 2, 3, 250, 0, 0, 0, 0]]), 8).tolist() == [[0xFA030201, 0]]
    five = pack(np.array([[1, 2, 3, 4, 5, 6, 7, 31] + [0] * 24]), 5)  # 32 values: 160 bits, 5 words
    assert five.shape == (1, 5) and five[0, 0] == 1 | 2 << 5 | 3 << 10 | 4 << 15 | 5 << 20 | 6 << 25 | (7 & 3) << 30
    assert five[0, 1] == 7 >> 2 | 31 << 3  # the seventh value straddles the first two words


def test_a_value_off_the_grid_is_refused():
    blocks = np.zeros((1, 18), dtype=np.uint8)  # one Q4_0 block: d (float16), then 16 bytes of nibbles
    blocks[0, :2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    values = np.full((1, 32), 0.5 * (0 - 8), dtype=np.float32)
    assert exact_grid("Q4_0", blocks, values) is not None
    values[0, 3] += 0.25  # between two steps of 0.5
    assert exact_grid("Q4_0", blocks, values) is None
    assert exact_grid("Q6_K", blocks, values) is None
