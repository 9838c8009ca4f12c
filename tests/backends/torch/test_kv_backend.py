"""The torch backend honours --kv: every policy loads, streams past the context at bounded bytes
(windowed), reports the cost model's bytes, and refuses a shape it cannot quantize up front."""
from __future__ import annotations

import io
import json

import pytest
import torch

from localctx.app import cli
from localctx.backends.base import GenerationParams
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.policy_cache import PolicyKVCache
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
CFG = TinyConfig(hidden=64, n_heads=2, n_kv_heads=1, head_dim=32)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", CFG, tiny_weights(CFG, seed=3))


def session_for(path, text: str, context: int = 96):
    loaded = load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)
    return build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse(text), context), OPTIONS)


@pytest.mark.parametrize("text", ["int8", "int4+res16", "fp16+sink4+win32", "int4+sink4+win40", "int8+win48+heavy8"])
def test_each_policy_generates_with_the_cost_models_bytes(tiny_gguf, text):
    s = session_for(tiny_gguf, text)
    assert isinstance(s.engine.cache, PolicyKVCache)
    assert s.decode_threads == torch.get_num_threads()  # a CPU engine keeps its threads busy
    events = list(s.generate("the hat in the tent " * 4, GenerationParams(max_tokens=40)))
    last = events[-1].stats
    streamed = s.engine.cache.length(0)
    assert last.kv_bytes == cost.kv_bytes(s.spec, s.plan.policy, streamed)
    assert last.kv_tokens == cost.held_tokens(s.plan.policy, streamed)


def test_a_windowed_policy_streams_past_the_context(tiny_gguf):
    s = session_for(tiny_gguf, "int4+sink4+win40", context=64)
    events = list(s.generate("the tent " * 30, GenerationParams(max_tokens=120)))
    last = events[-1].stats
    assert last.generated_tokens == 120 and last.prompt_tokens + 120 > 64
    assert last.kv_tokens <= 4 + 40 + 31
    assert last.kv_bytes <= cost.max_kv_bytes(s.spec, s.plan.policy, 10_000)


def test_a_second_turn_over_a_quantized_prefix_matches_a_fresh_session(tiny_gguf):
    params = GenerationParams(max_tokens=6)
    turn1 = [{"role": "user", "content": "the tent in the sea " * 6}]
    s = session_for(tiny_gguf, "int8", context=256)
    answer = "".join(e.text for e in s.generate(turn1, params))
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and the hat?"}]
    again = [e.token for e in s.generate(turn2, params) if e.kind == "token"]
    fresh = [e.token for e in session_for(tiny_gguf, "int8", context=256).generate(turn2, params) if e.kind == "token"]
    assert again == fresh


def test_cli_run_honours_kv(tiny_gguf, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    monkeypatch.setenv("LOCALCTX_TORCH_DEVICE", "cpu")
    monkeypatch.setenv("LOCALCTX_TORCH_DTYPE", "fp32")
    code = cli.main(["run", "-m", str(tiny_gguf), "--backend", "torch", "--kv", "int4+sink4+win32", "--context", "64",
                     "--max-tokens", "80", "--raw", "--json", "the hat " * 10])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["stats"]["generated_tokens"] == 80
    assert data["stats"]["policy"] == "int4+sink4+win32"
    assert data["stats"]["kv_tokens"] <= 4 + 32 + 31


def test_a_head_dim_the_group_does_not_divide_is_refused_before_generation(tmp_path):
    cfg = TinyConfig()  # head dim 8
    path = write_gguf(tmp_path / "t.gguf", cfg, tiny_weights(cfg, seed=1))
    with pytest.raises(UserError, match="not a multiple of the group size"):
        session_for(path, "int4")


@pytest.mark.parametrize("text", ["int8+res16", "int4+sink4+win40"])
def test_batched_decode_under_a_policy_matches_one_at_a_time(tiny_gguf, text):
    prompts = ["the hat in the tent " * 3, "the sea " * 9]
    params = GenerationParams(max_tokens=30)
    batch = session_for(tiny_gguf, text, context=256)
    together: dict[int, list[int]] = {0: [], 1: []}
    for i, event in batch.generate_batch(prompts, params):
        if event.kind == "token":
            together[i].append(event.token)
    for i, prompt in enumerate(prompts):
        alone = [e.token for e in session_for(tiny_gguf, text, context=256).generate(prompt, params)
                 if e.kind == "token"]
        assert together[i] == alone


@pytest.mark.parametrize("name", ["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"])
def test_the_planner_counts_the_kv_element_every_torch_dtype_name_holds(monkeypatch, name):
    from localctx.backends.torch.backend import DTYPE_BYTES, TorchBackend
    from localctx.backends.torch.loading import DTYPES
    from localctx.kvcache.hardware_profile import HardwareProfile
    from localctx.kvcache.known_models import known_spec

    assert DTYPE_BYTES.keys() == DTYPES.keys()  # the loader takes no name the planner does not know
    here = HardwareProfile("cpu", "test CPU", 2**34, 2**33, 2e10, "table")
    monkeypatch.setenv("LOCALCTX_TORCH_DTYPE", name)
    assert TorchBackend().kv_elem_bytes(known_spec("llama-3-8b"), here) == torch.empty((), dtype=DTYPES[name]).element_size()
