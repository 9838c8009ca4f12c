"""The torch backend's model and loaders on tiny random-weight models: GGUF and HF folders load
the same model, logits match an independent cache-free forward, and greedy decoding with the
paged cache gives the tokens a cache-free recomputation gives."""
from __future__ import annotations

import pytest
import torch

from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.backends.torch.rope import RopeScaling, inverse_frequencies
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import (TinyConfig, greedy_without_cache, reference_logits, tiny_weights, write_gguf,
                               write_hf)

FP32 = TorchOptions(device="cpu", dtype=torch.float32, block_size=4, prefill_chunk=5)


def session_for(ref: ModelRef, options: TorchOptions = FP32, context: int = 256):
    loaded = load_model(ref, options)
    return build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy(), context), options)


def full_logits(session, ids: list[int]) -> torch.Tensor:
    engine = session.engine
    engine.cache.add_sequence(99)
    try:
        return engine.prefill(99, ids, all_logits=True)
    finally:
        engine.cache.finish(99)


IDS = [5, 77, 200, 31, 9, 120, 64, 3, 250, 17, 88]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_and_hf_folder_match_the_reference_forward(tmp_path, arch):
    cfg = TinyConfig(arch=arch, tie=arch != "qwen2")
    w = tiny_weights(cfg, seed=1)
    ref = reference_logits(cfg, w, IDS)
    hf = session_for(ModelRef("hf", write_hf(tmp_path / "hf", cfg, w), "tiny", "folder"))
    gg = session_for(ModelRef("gguf", write_gguf(tmp_path / "tiny.gguf", cfg, w), "tiny", "file"))
    for session in (hf, gg):
        got = full_logits(session, IDS)  # chunked prefill (chunks of 5) through paged blocks of 4
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


def test_greedy_with_the_cache_equals_recomputing_without_it(tmp_path):
    cfg = TinyConfig()
    w = tiny_weights(cfg, seed=2)
    session = session_for(ModelRef("gguf", write_gguf(tmp_path / "t.gguf", cfg, w), "tiny", "file"))
    prompt = "the hat is in the tent"
    ids = session.tokenizer.encode(prompt)
    events = list(session.generate(prompt, _greedy(12)))
    got = [e.token for e in events if e.kind == "token"]
    want = greedy_without_cache(cfg, w, ids, 12)
    eos = session.tokenizer.eos_ids
    want = want[:next((i for i, t in enumerate(want) if t in eos), len(want))]
    assert got == want and len(got) > 3


def test_a_batch_gives_every_sequence_the_tokens_it_gets_alone(tmp_path):
    cfg = TinyConfig()
    w = tiny_weights(cfg, seed=3)
    session = session_for(ModelRef("hf", write_hf(tmp_path / "hf", cfg, w), "tiny", "folder"))
    prompts = ["a", "the other one is longer than the first", "in on er", "tent of the hat in the sea and sun"]
    params = _greedy(9)
    alone = []
    for p in prompts:
        session.reset()
        alone.append([e.token for e in session.generate(p, params) if e.kind == "token"])
    together: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    dones = {}
    for i, e in session.generate_batch(prompts, params):
        if e.kind == "token":
            together[i].append(e.token)
        else:
            dones[i] = e
    assert [together[i] for i in range(len(prompts))] == alone
    assert set(dones) == set(range(len(prompts)))
    assert session.engine.cache.pool.free_blocks == session.engine.cache.pool.n_blocks  # all blocks back


def test_batch_admits_as_the_pool_frees_blocks(tmp_path):
    """A pool that holds only two sequences at once still runs five, with the same tokens."""
    cfg = TinyConfig()
    w = tiny_weights(cfg, seed=4)
    path = write_gguf(tmp_path / "t.gguf", cfg, w)
    params = _greedy(6)
    prompts = [f"the tent {'in ' * k}the sea" for k in range(5)]
    small = session_for(ModelRef("gguf", path, "tiny", "file"), context=40)
    seen = {i: [] for i in range(5)}
    for i, e in small.generate_batch(prompts, params):
        if e.kind == "token":
            seen[i].append(e.token)
    big = session_for(ModelRef("gguf", path, "tiny", "file"), context=256)
    for i, p in enumerate(prompts):
        big.reset()
        assert seen[i] == [e.token for e in big.generate(p, params) if e.kind == "token"]


def test_fp32_and_bf16_agree_on_the_top_token(tmp_path):
    cfg = TinyConfig()
    w = tiny_weights(cfg, seed=5)
    ref = ModelRef("gguf", write_gguf(tmp_path / "t.gguf", cfg, w), "tiny", "file")
    a = full_logits(session_for(ref), IDS)
    b = full_logits(session_for(ref, TorchOptions(device="cpu", dtype=torch.bfloat16)), IDS)
    assert b.dtype == torch.float32
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.99


def test_int8_weights_stay_close_to_dense(tmp_path):
    cfg = TinyConfig()
    w = tiny_weights(cfg, seed=6)
    ref = ModelRef("gguf", write_gguf(tmp_path / "t.gguf", cfg, w), "tiny", "file")
    dense = full_logits(session_for(ref), IDS)
    int8 = full_logits(session_for(ref, TorchOptions(device="cpu", dtype=torch.float32, weights="int8")), IDS)
    assert torch.corrcoef(torch.stack([dense.flatten(), int8.flatten()]))[0, 1] > 0.995


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies():
    base = inverse_frequencies(128, 500000.0)
    scaled = inverse_frequencies(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    wavelen = 2 * torch.pi / base
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    assert torch.equal(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8)
    mid = ~high & ~low
    assert mid.any() and bool(((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all())


def test_hf_rope_scaling_reaches_the_model(tmp_path):
    cfg = TinyConfig()
    w = tiny_weights(cfg, seed=7)
    scaling = {"rope_type": "linear", "factor": 4.0}
    session = session_for(ModelRef("hf", write_hf(tmp_path / "hf", cfg, w, rope_scaling=scaling), "t", "folder"))
    inv = 1.0 / cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim) / 4.0
    torch.testing.assert_close(full_logits(session, IDS), reference_logits(cfg, w, IDS, inv), atol=2e-4, rtol=2e-4)


def test_pickled_weights_and_unknown_scaling_are_refused(tmp_path):
    folder = tmp_path / "pickled"
    write_hf(folder, TinyConfig(), tiny_weights(TinyConfig()))
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(UserError, match="pickled"):
        load_model(ModelRef("hf", folder, "p", "folder"), FP32)
    yarn = write_hf(tmp_path / "yarn", TinyConfig(), tiny_weights(TinyConfig()), rope_scaling={"rope_type": "yarn",
                                                                                               "factor": 4.0})
    with pytest.raises(UserError, match="yarn"):
        load_model(ModelRef("hf", yarn, "y", "folder"), FP32)


def test_cuda_options_are_refused_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError, match="no GPU"):
        TorchOptions(device="cuda", dtype=torch.float16).checked()
    with pytest.raises(UserError, match="not torch.float16"):
        TorchOptions(device="cpu", dtype=torch.float16).checked()


def _greedy(n: int):
    from localctx.backends.base import GenerationParams
    return GenerationParams(max_tokens=n, temperature=0.0)


def test_int8_linear_on_several_rows_matches_dense_and_leaves_its_input_alone():
    from localctx.backends.torch.linear import Int8Linear

    torch.manual_seed(0)
    weight = torch.randn(48, 32)
    layer = Int8Linear(weight, None, torch.float32)
    rows = torch.randn(5, 32)
    before = rows.clone()
    out = layer(rows)  # 5 rows: activations quantized per row, int8 × int8
    assert torch.equal(rows, before)
    dense = rows @ layer.dequantized().T
    assert (out - dense).abs().max() < 0.05 * dense.abs().max()
    single = layer(rows[:1])  # one row: the weight-only kernel
    assert torch.allclose(single, dense[:1], atol=1e-3, rtol=1e-3)
