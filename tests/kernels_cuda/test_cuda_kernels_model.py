"""The torch backend end to end with the (interpreted) Triton kernels behind its caches: a tiny
random-weight Llama gives the same logits through the kernels as through the references."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # set by the process that runs these, never in-process
    pytest.skip("the Triton interpreter tests run in their own process (tests/kernels_cuda/test_triton_interpreter.py)",
                allow_module_level=True)

import torch

from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kernels_cuda import dispatch
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

pytestmark = pytest.mark.skipif(not dispatch.triton_importable(), reason="Triton is not installed")

CFG = TinyConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, head_dim=64)  # the kernels tile D >= 32
OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8, prefill_chunk=7)
IDS = [5, 77, 200, 31, 9, 120, 64, 3, 250, 17, 88, 41, 6]


@pytest.fixture(scope="module")
def model_ref(tmp_path_factory) -> ModelRef:
    path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", CFG, tiny_weights(CFG, seed=4))
    return ModelRef("gguf", path, "tiny", "file")


def _logits(model_ref: ModelRef, mode: str, monkeypatch) -> list[torch.Tensor]:
    """Chunked prefill (every position's logits), then three greedy decode steps."""
    monkeypatch.setenv(dispatch.ENV, mode)
    loaded = load_model(model_ref, OPTIONS)
    session = build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy(), 128), OPTIONS)
    engine = session.engine
    engine.cache.add_sequence(0)
    out = [engine.prefill(0, IDS, all_logits=True)]
    for _ in range(3):
        out.append(engine.decode([0], [int(out[-1][-1].argmax())]))
    return out


def test_backend_logits_through_the_kernels_match_the_reference_path(model_ref, monkeypatch):
    want = _logits(model_ref, "off", monkeypatch)
    got = _logits(model_ref, "interpret", monkeypatch)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("policy_text", ["int4+res8+sink2+win40", "int8+win48+heavy8"])
def test_model_logits_through_the_policy_cache_kernels_match_the_reference(model_ref, monkeypatch, policy_text):
    """The same model over the policy cache (quantized KV, sinks + window, heavy hitters)."""
    monkeypatch.setenv(dispatch.ENV, "interpret")
    model = load_model(model_ref, OPTIONS).model
    shape = PolicyCacheShape(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim)
    policy = KVPolicy.parse(policy_text)
    caches = [PolicyKVCache(shape, policy, model.make_rope()),
              PolicyKVCache(shape, policy, model.make_rope(), attention=dispatch.policy_attention("cpu"),
                            quantize_groups=dispatch.quantize_groups("cpu"))]
    tokens = torch.tensor([(7 * i + 3) % 250 for i in range(120)])  # past both windows by a group
    results = []
    for cache in caches:
        cache.add_sequence(0)
        logits = []
        for chunk in (tokens[:40], *tokens[40:].split(8)):
            cache.begin_step([0], chunk.numel())
            logits.append(model.forward(chunk[None], cache, all_logits=True)[0])
            cache.end_step()
        results.append(torch.cat(logits))
    assert caches[0].evicted_tokens() > 0 and caches[0].kv_bytes() == caches[1].kv_bytes()
    got, want = results[1], results[0]
    # until the first group ages (token g = 32; a chunk's later queries see it quantized, as decoding
    # would: kvcache/chunk_view.py), nothing is quantized: float error only
    g = policy.group_size
    torch.testing.assert_close(got[:g], want[:g], atol=1e-4, rtol=1e-4)
    # later, a layer's K/V derive from the previous layer's attention, so a 1e-7 difference can
    # move a value across a rounding boundary of the quantizer: bounded, and the top token holds
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
