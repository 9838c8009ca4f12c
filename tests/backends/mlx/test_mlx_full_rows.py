"""The full-precision rows of an MLX layer cache, written in place (backends/mlx/full_rows.py): what
is held, what is allocated, and snapshots that stay exact while later steps write the buffer."""
import time

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends.mlx.full_rows import FullRows  # noqa: E402
from localctx.backends.mlx.lm_cache import PolicyKVCache  # noqa: E402
from localctx.backends.mlx.policy_cache import FULL_STEP, CacheShape  # noqa: E402
from localctx.kvcache import cost  # noqa: E402
from localctx.kvcache.model_spec import ModelSpec  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

H_KV, D = 2, 64
SPEC = ModelSpec(name="tiny", architecture="llama", n_layers=1, n_heads=4, n_kv_heads=H_KV, head_dim=D,
                 hidden_size=4 * D, vocab_size=10, context_length=4096)
SHAPE = CacheShape(H_KV, D, mx.float16, traditional_rope=False)
ROW_BYTES = 2 * H_KV * D * 2  # keys and values, float16


def rows(rng, n: int) -> mx.array:
    return mx.array(rng.standard_normal((1, H_KV, n, D)).astype(np.float32))


def test_a_plain_cache_grows_by_steps_and_reports_held_and_allocated_bytes():
    rng = np.random.default_rng(0)
    layer = PolicyKVCache(KVPolicy.parse("fp16"), SHAPE)
    feeds = [100, *[1] * 160, 300, 1]
    for n in feeds:
        k = rows(rng, n)
        layer.update_and_fetch(k, k)
        assert layer.nbytes() == cost.kv_bytes(SPEC, layer.policy, layer.n_seen)  # held: the cost model
        capacity = layer.full.capacity
        assert layer.allocated_bytes() == capacity * ROW_BYTES
        assert layer.n_seen <= capacity < layer.n_seen + FULL_STEP
    # capacities are multiples of the step: 100 → 256 rows, the 157th single row grows them to 512,
    # the 300-row chunk (560 held) to 768
    assert FULL_STEP == 256 and layer.full.capacity == 768


def test_a_decode_step_writes_in_place_without_copying_the_rows():
    layer = PolicyKVCache(KVPolicy.parse("fp16"), CacheShape(8, D, mx.float16, False))
    big = mx.zeros((1, 8, 100_000, D))
    layer.update_and_fetch(big, big)
    mx.eval(layer.full.k, layer.full.v)
    one = mx.ones((1, 8, 1, D))
    start = time.perf_counter()
    for _ in range(20):
        layer.update_and_fetch(one, one)
        layer.held = None  # what attention would take
        mx.eval(layer.full.k, layer.full.v)
    per_step = (time.perf_counter() - start) / 20
    held = np.array(layer.k_full[:, -21:].astype(mx.float32))
    assert np.all(held[:, 0] == 0) and np.all(held[:, 1:] == 1)
    # a copy of 100,000 rows x 8 heads x 64 (2 x 100 MB at float16) per step would take far longer
    assert per_step < 0.02, f"{per_step * 1e3:.1f} ms a step: the rows were copied"


def test_snapshots_stay_exact_when_an_older_one_is_restored_and_written_over():
    rng = np.random.default_rng(1)
    layer = PolicyKVCache(KVPolicy.parse("fp16"), SHAPE)
    k = rows(rng, 10)
    layer.update_and_fetch(k, k)
    first = layer.snapshot()
    a = rows(rng, 1)
    layer.update_and_fetch(a, a)
    second = layer.snapshot()
    second_keys = np.array(layer.k_full)
    layer.restore(first)
    b = rows(rng, 1) + 5
    layer.update_and_fetch(b, b)  # the row after the first snapshot, written anew
    assert np.allclose(np.array(layer.k_full[:, -1]), np.array(b[0, :, 0].astype(mx.float16)))
    layer.restore(second)
    assert np.array_equal(np.array(layer.k_full), second_keys)
    c = rows(rng, 1)
    layer.update_and_fetch(c, c)
    assert np.array_equal(np.array(layer.k_full[:, :11]), second_keys)


def test_a_quantizing_cache_keeps_its_spare_rows_under_a_group():
    rng = np.random.default_rng(2)
    policy = KVPolicy.parse("int4")
    layer = PolicyKVCache(policy, SHAPE)
    for n in [128, *[1] * 80]:
        k = rows(rng, n)
        layer.update_and_fetch(k, k)
        assert layer.nbytes() == cost.kv_bytes(SPEC, policy, layer.n_seen)
        spare = layer.full.capacity - layer.full.n
        assert 0 <= spare < policy.group_size
        assert layer.allocated_bytes() == layer.nbytes() + spare * ROW_BYTES


def test_rows_restored_from_a_snapshot_copy_before_they_are_written():
    k = mx.zeros((1, 4, 2))
    full = FullRows.empty(1, 2, mx.float32).append(k[:, :2], k[:, :2], step=4)
    assert full.capacity == 4 and full.owned
    grown = full.append(mx.ones((1, 1, 2)), mx.ones((1, 1, 2)), step=4)
    assert grown.k is full.k  # written in place
    again = full.restored().append(mx.ones((1, 1, 2)) * 2, mx.ones((1, 1, 2)) * 2, step=4)
    assert again.k is not full.k and np.array_equal(np.array(grown.keys()[0, 2]), [1, 1])
