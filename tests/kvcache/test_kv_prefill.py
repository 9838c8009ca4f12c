"""Chunked prefill through the policy cache attends exactly as decoding the same tokens one at a
time: for every policy family (quantized with a residual and the unbounded cache's head group,
sinks + window, heavy hitters, a model's own sliding layers, combinations) the outputs of chunks
of 7, 64 and everything at once equal token-by-token decode's, and the cache holds the same
tokens, groups and bytes afterwards (kvcache/chunk_view.py)."""
import pytest
import torch

from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, load_model
from localctx.backends.torch.rope import Rope
from localctx.kvcache import cost
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.policy_cache import PolicyCacheShape, PolicyKVCache
from localctx.kvcache.quant_attention import attend_reference
from localctx.kvcache.model_spec import ModelSpec
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

L, H, HKV, D, N = 2, 4, 2, 32, 120
POLICIES = ["int8", "int4+res16", "int4+g32+sink3+res40", "fp16+win40", "fp16+sink4+win40", "int4+sink4+win64",
            "int8+res16+sink2+win64", "int4+res16+win40", "k8v4+res16", "kf16v4+sink4+win64", "fp16+sink4+win40+heavy8", "int8+sink2+win64+heavy32"]
CASES = ([(p, ()) for p in POLICIES]  # and a model's own window on layer 0, larger and smaller than the policy's
         + [(p, (48, None)) for p in ("int4+sink4+win64", "fp16", "int8+res16", "fp16+sink4+win40+heavy8")]
         + [(p, (20, None)) for p in ("int4+res16+win40", "int8+sink2+win64+heavy32", "fp16+sink4+win40")])
CHUNKINGS = [[7], [64], [N], [37, 1, 1, 90]]
ONE_LAYER = ModelSpec("one", "llama", n_layers=1, n_heads=H, n_kv_heads=HKV, head_dim=D, hidden_size=H * D,
                      vocab_size=64, context_length=4096, kv_elem_bytes=4)


def state(cache: PolicyKVCache) -> list:
    """What every layer holds: stream indices, quantized codes and scales, bytes."""
    out = [cache.kv_bytes(0), cache.length(0)]
    for layer in cache._seqs[0].layers:
        full_idx, group_idx = layer.stream_indices()
        out.append((full_idx.tolist(), None if group_idx is None else group_idx.tolist(), layer.n_groups))
        if layer.n_groups:
            out.append([rows.view.clone() for name, rows in sorted(layer.rows().items()) if name.startswith(("qk", "qv"))])
    return out


def same_state(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else (
        same_state(x, y) if isinstance(x, list) and x and isinstance(x[0], torch.Tensor) else x == y)
        for x, y in zip(a, b)) and len(a) == len(b)


def stream_cache(text: str, chunks: list[int], windows=(), attention=attend_reference, n_tokens: int = N):
    """Random q/k/v for ``n_tokens`` tokens (the same whatever the chunking) through every layer,
    in steps of ``chunks`` (repeated)."""
    gen = torch.Generator().manual_seed(0)
    qs, ks, vs = (torch.randn(L, n_tokens, h, D, generator=gen) for h in (H, HKV, HKV))
    cache = PolicyKVCache(PolicyCacheShape(L, HKV, D), KVPolicy.parse(text), Rope(D, 10000.0),
                          attention=attention, layer_windows=windows)
    cache.add_sequence(0)
    outs, n, i = [], 0, 0
    while n < n_tokens:
        T = min(chunks[i % len(chunks)], n_tokens - n)
        i += 1
        cache.begin_step([0], T)
        outs.append(torch.stack([cache.attend(j, qs[j, None, n:n + T], ks[j, None, n:n + T],
                                              vs[j, None, n:n + T])[0] for j in range(L)]))
        cache.end_step()
        n += T
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("text,windows", CASES)
def test_a_chunk_attends_as_decoding_does(text, windows):
    decoded, ref = stream_cache(text, [1], windows)
    for chunks in CHUNKINGS:
        out, cache = stream_cache(text, chunks, windows)
        assert torch.allclose(out, decoded, atol=2e-5), f"{text} in chunks {chunks}: {(out - decoded).abs().max()}"
        assert same_state(state(cache), state(ref)), f"{text} in chunks {chunks} holds another cache"
        assert cache.kv_bytes(0) == sum(cost.kv_bytes(ONE_LAYER, p, N) for p in cache.layer_policies)


def test_decode_steps_stay_on_the_given_kernel_and_masked_chunks_do_not_reach_it():
    """The kernel behind ``attention`` takes no per-query mask: a chunk that ages or evicts runs
    the reference; a decode step, and a chunk that only appends, run the kernel."""
    calls = []

    def kernel(q, q_positions, full, quant, rope, *, scale=None, want_mass=False):
        calls.append(q.shape[0])
        return attend_reference(q, q_positions, full, quant, rope, scale=scale, want_mass=want_mass)

    steps = [20, 1, 1, 30, 40, 1, 30, 1]
    stream_cache("int4+res16+sink4+win64", steps, attention=kernel, n_tokens=sum(steps))
    # 20, then 30 after 22: nothing ages or leaves before their last query (the kernel); 40 after
    # 52: two groups age (masked); 30 after 93: the window moves (masked); single tokens: the kernel
    assert calls == [20] * L + [1] * 2 * L + [30] * L + [1] * L + [1] * L


# -- the same on models: logits of chunked prefill equal token-by-token decode's -------------------
CFG = TinyConfig(hidden=64, n_heads=2, n_kv_heads=1, head_dim=32)
IDS = [(i * 37 + 11) % 250 for i in range(100)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", CFG, tiny_weights(CFG, seed=3))
    # float64 activations: a chunk's matmuls round differently from a token's, and in float32 that
    # can move a key across a quantization step (a code off by one); in float64 it cannot, and the
    # cache stores float32 either way
    return load_model(ModelRef("gguf", path, "tiny", "file"), TorchOptions(device="cpu", dtype=torch.float64)).model


def model_logits(model, text: str, chunk: int, ids: list[int]):
    c = model.config
    cache = PolicyKVCache(PolicyCacheShape(c.n_layers, c.n_kv_heads, c.head_dim), KVPolicy.parse(text),
                          model.make_rope(), layer_windows=model.layer_windows())
    cache.add_sequence(0)
    tokens, outs = torch.tensor(ids), []
    for start in range(0, len(ids), chunk):
        part = tokens[start:start + chunk]
        cache.begin_step([0], part.numel())
        outs.append(model.forward(part[None], cache, all_logits=True)[0])
        cache.end_step()
    return torch.cat(outs), cache


@pytest.mark.parametrize("text", ["int4+res16", "fp16+sink4+win40", "int8+sink2+win64+heavy32"])
def test_a_models_chunked_prefill_gives_decodings_logits(llama, text):
    decoded, ref = model_logits(llama, text, 1, IDS)
    for chunk in (7, 64, len(IDS)):
        logits, cache = model_logits(llama, text, chunk, IDS)
        assert torch.allclose(logits, decoded, atol=1e-4), f"{text}, chunk {chunk}: {(logits - decoded).abs().max()}"
        assert same_state(state(cache), state(ref))


@pytest.fixture(scope="module")
def gemma():
    from gemma3_tiny import (EPS, FFN, GLOBAL_BASE, HEAD_DIM, HIDDEN, LOCAL_BASE, N_HEADS, N_KV, N_LAYERS,
                             QUERY_SCALE, VOCAB, tiny_tensors)
    from localctx.backends.torch.gemma3 import Gemma3Config, Gemma3Model

    windows = tuple(None if (i + 1) % 3 == 0 else 40 for i in range(N_LAYERS))  # windows a group can age in
    config = Gemma3Config(architecture="gemma3", n_layers=N_LAYERS, hidden_size=HIDDEN, n_heads=N_HEADS,
                          n_kv_heads=N_KV, head_dim=HEAD_DIM, intermediate_size=FFN, vocab_size=VOCAB,
                          context_length=1024, layer_windows=windows, query_scale=QUERY_SCALE, norm_eps=EPS,
                          rope_base=GLOBAL_BASE, local_rope_base=LOCAL_BASE)
    return Gemma3Model(config, {k: torch.from_numpy(v) for k, v in tiny_tensors().items()}, dtype=torch.float64)


@pytest.mark.parametrize("text", ["int4", "int8+sink2+win24", "fp16+sink2+win16+heavy4"])
def test_a_sliding_models_chunked_prefill_gives_decodings_logits(gemma, text):
    ids = [i % 64 for i in IDS[:60]]  # past the 40-token windows: groups age in them and leave
    decoded, ref = model_logits(gemma, text, 1, ids)
    for chunk in (7, 64, len(ids)):
        logits, cache = model_logits(gemma, text, chunk, ids)
        assert torch.allclose(logits, decoded, atol=1e-4), f"{text}, chunk {chunk}: {(logits - decoded).abs().max()}"
        assert same_state(state(cache), state(ref))
