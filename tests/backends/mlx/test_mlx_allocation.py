"""What the MLX backend says it allocates: MLX reserves nothing at load and its caches' buffers grow as
tokens arrive (backends/mlx/full_rows.py, mlx-lm's own caches), so the plan is not sized to the request
as llama.cpp's is; after each step it holds what the buffers take, which the stats line and --json show
beside the bytes held (the cost model's count)."""
import json

import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX model zoo needs mlx-lm (pip install 'mlx-lm[cpu]' on Linux)")

from gguf_tiny import ARCHS, write  # noqa: E402
from localctx.backends.base import GenerationParams  # noqa: E402
from localctx.backends.mlx.backend import held_in_compute_dtype  # noqa: E402
from localctx.backends.mlx.lm_cache import NativeCache  # noqa: E402
from localctx.backends.mlx.policy_cache import FULL_STEP  # noqa: E402
from localctx.backends.models.spec_reader import gguf_spec  # noqa: E402
from localctx.kvcache import cost  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

from test_mlx_backend import tiny_folder  # noqa: E402,F401  (a fixture)
from test_mlx_zoo import folder_session, write_phi3  # noqa: E402

PROMPT = "the cache keeps sinks and a window of recent tokens " * 2


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write(tmp_path_factory.mktemp("mlx-allocation") / "llama.gguf", ARCHS["llama"])


def test_run_on_mlx_reports_the_buffers_it_grew_not_a_reservation(cli, tiny_gguf):
    # the caches hold the dtype the model computes in (float32 on a CPU), and the plan counts it so
    spec, fp16 = held_in_compute_dtype(gguf_spec(tiny_gguf)), KVPolicy.parse("fp16")
    res = cli("run", "-m", str(tiny_gguf), "--backend", "mlx", "--kv", "fp16", "--max-tokens", "4", "--json", "hello")
    assert res.code == 0, res.err
    out = json.loads(res.out)
    held = out["stats"]["kv_tokens"]
    assert 0 < held < FULL_STEP
    # one 256-row step of float16 buffers per layer (llama.cpp's sizing would say 5 bytes + 128 + 4 = 137 tokens)
    assert out["allocated_context"] == FULL_STEP
    assert out["allocated_kv_bytes"] == cost.kv_bytes(spec, fp16, FULL_STEP)
    assert out["stats"]["kv_bytes"] == cost.kv_bytes(spec, fp16, held) < out["allocated_kv_bytes"]
    assert out["planned_kv_bytes"] == cost.kv_bytes(spec, fp16, spec.context_length)
    res = cli("run", "-m", str(tiny_gguf), "--backend", "mlx", "--kv", "fp16", "--max-tokens", "4", "hello")
    assert res.code == 0, res.err
    assert f"of {cost.format_bytes(out['allocated_kv_bytes'])} allocated ({FULL_STEP} tokens; " in res.err


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4+g32+res8"])
def test_the_plan_follows_the_policy_caches_buffers(tiny_folder, tmp_path, kv):  # noqa: F811
    session, spec = folder_session(write_phi3(tmp_path / "phi3", tiny_folder), kv)
    assert (session.plan.allocated_context, session.plan.allocated_bytes) == (0, 0)  # nothing reserved at load
    done = list(session.generate(PROMPT, GenerationParams(max_tokens=12)))[-1]
    layers, n = session.cache.layers, session.cache.n_seen
    buffers = sum(layer.full.k.nbytes + layer.full.v.nbytes for layer in layers)
    quantized = sum(layer.store.nbytes() for layer in layers if layer.store.n_tokens)
    assert session.plan.allocated_bytes == buffers + quantized > done.stats.kv_bytes == cost.kv_bytes(spec, session.plan.policy, n)
    assert session.plan.allocated_context == n + min(layer.full.capacity - layer.full.n for layer in layers)
    session.reset()
    assert (session.plan.allocated_context, session.plan.allocated_bytes) == (0, 0)


def test_mlx_lms_own_caches_count_the_rows_held_and_allocate_their_buffers(tiny_folder, tmp_path):  # noqa: F811
    from mlx_lm.models.cache import RotatingKVCache

    session, spec = folder_session(write_phi3(tmp_path / "phi3", tiny_folder))
    session.cache = NativeCache(session.model.model, 512)  # as for a model with sliding layers
    done = list(session.generate(PROMPT, GenerationParams(max_tokens=12)))[-1]
    layers, n = session.cache.layers, session.cache.n_seen
    row = 2 * spec.n_kv_heads * spec.head_dim * layers[0].keys.dtype.size  # a key and a value, in the model's dtype
    assert done.stats.kv_bytes == len(layers) * n * row  # the rows in use, not the buffers' spare ones
    assert session.plan.allocated_bytes == sum(c.nbytes for c in layers) == len(layers) * 256 * row
    assert session.plan.allocated_context == 256  # mlx-lm's KVCache grows 256 rows at a time
    # a full sliding window rotates in place: it holds its window and never grows
    cache = NativeCache(session.model.model, 512)
    cache.layers = [RotatingKVCache(max_size=16) for _ in layers]
    for tok in range(40):
        session.model.model(mx.array([[tok % 50 + 3]]), cache=cache.layers)
        cache.stepped(1)
    assert cache.nbytes() == len(layers) * 16 * row
    assert cache.allocated() == (512, sum(c.nbytes for c in cache.layers))


def test_plan_says_mlx_allocates_as_the_cache_fills(cli, tiny_gguf):
    mlx = cli("plan", "-m", str(tiny_gguf), "--backend", "mlx", "--kv", "fp16")
    assert mlx.code == 0, mlx.err
    assert "allocated as the cache fills" in mlx.out and "run, its prompt + --max-tokens" not in mlx.out
