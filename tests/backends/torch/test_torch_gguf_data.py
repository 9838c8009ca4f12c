"""The torch loader reads tensor bytes through the fast header's offsets: the same arrays, shapes and
dtypes that gguf's GGUFReader gives, for plain, half and block-quantised tensors."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from localctx.backends.models.gguf_header import read_header  # noqa: E402
from localctx.backends.models.gguf_header import tensor_data  # noqa: E402
from localctx.backends.torch.gguf_loader import dequantize  # noqa: E402
from gguf_tiny import write_every_type  # noqa: E402


def assert_same_data(path):
    from gguf import GGUFReader
    from gguf.quants import dequantize as reference

    ref = {t.name: t for t in GGUFReader(str(path)).tensors}
    weights = np.memmap(path, dtype=np.uint8, mode="r")
    for t in read_header(path).tensors:
        mine, want = tensor_data(weights, t), ref[t.name].data
        assert mine.dtype == want.dtype and mine.shape == want.shape and np.array_equal(mine, want), t.name
        expected = np.asarray(reference(want, ref[t.name].tensor_type), dtype=np.float32)
        assert np.array_equal(dequantize(weights, t).numpy(), expected.reshape(tuple(reversed(t.shape)))), t.name


def test_plain_half_and_q8_tensors_match_gguf_reader(tmp_path):
    assert_same_data(write_every_type(tmp_path / "all.gguf"))


@pytest.mark.slow
def test_every_smollm2_tensor_matches_gguf_reader(smollm2_path):
    assert_same_data(smollm2_path)
