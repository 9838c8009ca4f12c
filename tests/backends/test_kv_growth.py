"""KV sized to the work: a session that allocates less than its plan's context grows when a prompt and
its answer need more (llama.cpp: its cells move into a larger context; torch: into a larger paged cache),
and answers exactly as a session that allocated the maximum from the start (greedy, fp16), reusing
what it had cached."""
from __future__ import annotations

import pytest
import torch

from localctx.backends.base import GenerationParams
from localctx.backends.fake.session import FAKE_SPEC
from localctx.backends.models.ref import ModelRef, resolve
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache import cost
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

FIRST = [{"role": "user", "content": "the tent in the sea " * 6}]
PARAMS = GenerationParams(max_tokens=24)


def follow_up(answer: str) -> list[dict]:
    return FIRST + [{"role": "assistant", "content": answer},
                    {"role": "user", "content": "and the hat on the mat by the sea? " * 14}]


def conversation(session) -> list[tuple[list[int], int]]:
    """Two turns: (tokens, cached tokens) of each."""
    out = []
    events = list(session.generate(FIRST, PARAMS))
    out.append(([e.token for e in events if e.kind == "token"], events[-1].stats.cached_tokens))
    events = list(session.generate(follow_up("".join(e.text for e in events)), PARAMS))
    out.append(([e.token for e in events if e.kind == "token"], events[-1].stats.cached_tokens))
    return out


def test_a_plan_sized_to_the_work_rounds_to_cells_and_keeps_the_maximum():
    spec = FAKE_SPEC
    plan = Plan.fixed("llamacpp", spec, KVPolicy(), 8192)
    sized = plan.sized_to(300, 256, lambda n: cost.max_kv_bytes(spec, plan.policy, n))
    assert (sized.allocated_context, sized.context) == (512, 8192)
    assert sized.allocated_bytes == cost.max_kv_bytes(spec, plan.policy, 512) < sized.kv_bytes == plan.kv_bytes
    assert sized.to_dict()["allocated_context"] == 512 and "grows to" in sized.allocation_words()
    assert plan.sized_to(9000, 256, lambda n: 0).allocated_context == 8192  # never past the context
    windowed = Plan.fixed("llamacpp", spec, KVPolicy.parse("fp16+sink4+win1024"), 8192)
    assert windowed.sized_to(300, 256, lambda n: 0) is windowed  # a window's capacity is fixed


# -- llama.cpp -----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_llamacpp(request, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from gguf_tiny import ARCHS, write

    return write(tmp_path_factory.mktemp("grow") / f"{request.param}.gguf", ARCHS[request.param])


def llamacpp_session(path, allocate: int | None):
    from localctx.backends.llamacpp.backend import LlamaCppBackend
    from localctx.backends.models.spec_reader import gguf_spec

    spec = gguf_spec(path)
    plan = Plan.fixed("llamacpp", spec, KVPolicy(), 2048)
    if allocate is not None:
        backend = LlamaCppBackend()
        plan = plan.sized_to(allocate, backend.kv_cell_tokens,
                             lambda n: backend.kv_allocation()(spec, plan.policy, n))
    return LlamaCppBackend().load(resolve(str(path)), plan)


def test_llamacpp_grows_its_context_and_answers_as_the_full_allocation(tiny_llamacpp):
    full = llamacpp_session(tiny_llamacpp, None)
    small = llamacpp_session(tiny_llamacpp, 100)
    try:
        assert int(full.llm.n_ctx()) == 2048 and int(small.llm.n_ctx()) == 256
        expected = conversation(full)
        got = conversation(small)
        assert got == expected
        assert got[1][1] > 0  # the second turn reused the cells moved into the larger context
        assert int(small.llm.n_ctx()) == small.plan.allocated_context >= 512
        assert small.plan.allocated_bytes == small.allocated_bytes(small.plan.allocated_context) < small.allocated_bytes(2048)
        assert small.plan.context == 2048
    finally:
        full.close()
        small.close()


def test_llamacpp_grows_a_compact_swa_cache_and_still_reuses_a_prompt_that_departs_before_its_end(tmp_path):
    """A chat's next prompt often departs from the cache a few tokens before its end (the template renders
    the answer's text, which need not tokenize as it was generated). A compact SWA cache keeps a batch of
    cells behind its window for that; growing must not lose them, or the whole conversation is prefilled
    again: the grown session reuses as much as the one allocated in full."""
    pytest.importorskip("llama_cpp")
    import dataclasses

    from gguf_tiny import ARCHS, write

    path = write(tmp_path / "gemma3-w32.gguf", dataclasses.replace(ARCHS["gemma3"], sliding_window=32))
    first = [{"role": "user", "content": "the tent in the sea " * 20}]
    params = GenerationParams(max_tokens=24)

    def two_turns(session) -> list[tuple[list[int], int]]:
        events = list(session.generate(first, params))
        answer = "".join(e.text for e in events if e.kind == "token")
        second = first + [{"role": "assistant", "content": answer[:-3]},  # departs a few tokens before the end
                          {"role": "user", "content": "and the hat on the mat by the sea? " * 14}]
        out = [([e.token for e in events if e.kind == "token"], events[-1].stats.cached_tokens)]
        events = list(session.generate(second, params))
        return out + [([e.token for e in events if e.kind == "token"], events[-1].stats.cached_tokens)]

    full, small = llamacpp_session(path, None), llamacpp_session(path, 100)
    try:
        assert not small.settings.swa_full and int(small.llm.n_ctx()) == 256
        expected, got = two_turns(full), two_turns(small)
        assert int(small.llm.n_ctx()) >= 512  # it grew for the second turn
        assert got == expected  # the same answers, and as many tokens reused (more than the window)
        assert got[1][1] > 32
    finally:
        full.close()
        small.close()


# -- torch ---------------------------------------------------------------------------------------

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)


@pytest.fixture(scope="module")
def tiny_torch(tmp_path_factory):
    cfg = TinyConfig()
    return write_gguf(tmp_path_factory.mktemp("grow-torch") / "tiny.gguf", cfg, tiny_weights(cfg, seed=11))


def torch_session(path, policy: str, allocate: int | None):
    loaded = load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)
    plan = Plan.fixed("torch", loaded.spec, KVPolicy.parse(policy), 1024)
    if allocate is not None:
        plan = plan.sized_to(allocate, OPTIONS.block_size, lambda n: cost.max_kv_bytes(loaded.spec, plan.policy, n))
    return build_session(loaded, plan, OPTIONS)


def test_torch_grows_its_cache_and_answers_as_the_full_allocation(tiny_torch):
    full = torch_session(tiny_torch, "fp16", None)
    small = torch_session(tiny_torch, "fp16", 40)
    assert full.engine.cache.pool.capacity_tokens == 1024 and small.engine.cache.pool.capacity_tokens == 40
    # what it allocated at load is counted in the element size it holds (float32 on a CPU), as after growing
    assert small.spec.kv_elem_bytes == torch.empty((), dtype=OPTIONS.dtype).element_size()
    assert small.plan.allocated_bytes == cost.max_kv_bytes(small.spec, small.plan.policy, 40)
    expected = conversation(full)
    got = conversation(small)
    assert got == expected
    assert got[1][1] > 0  # the second turn reused the K/V moved into the larger cache
    grown = small.engine.cache.pool.capacity_tokens
    assert 80 <= grown == small.plan.allocated_context < 1024
    assert small.plan.allocated_bytes == cost.max_kv_bytes(small.spec, small.plan.policy, grown)


@pytest.fixture(scope="module")
def tiny_gemma3_torch(tmp_path_factory):
    """Gemma 3 with a 16-token sliding window: its local layers hold fewer rows than its global one
    once a conversation is past the window, so a sequence's layers are not all the same length."""
    pytest.importorskip("gguf")
    import dataclasses

    from gguf_tiny import ARCHS, write

    cfg = dataclasses.replace(ARCHS["gemma3"], sliding_window=16, tokenizer_pre="gpt2")
    return write(tmp_path_factory.mktemp("grow-gemma3") / "gemma3.gguf", cfg)


def test_torch_grows_a_sliding_window_model_and_answers_as_the_full_allocation(tiny_gemma3_torch):
    full = torch_session(tiny_gemma3_torch, "fp16", None)
    small = torch_session(tiny_gemma3_torch, "fp16", 40)
    expected = conversation(full)
    got = conversation(small)  # moved its local layers' 16 rows and its global layer's whole history
    assert got == expected  # the same answers, and as much of the first turn reused
    assert 80 <= small.engine.cache.pool.capacity_tokens == small.plan.allocated_context < 1024
