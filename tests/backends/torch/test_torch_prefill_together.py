"""Engine.prefill_together (backends/torch/engine.py) on a tiny random-weight GGUF: prompts of
similar length prefilled in one padded forward give the logits and the cache that prefilling
them one at a time gives (the pad's K/V is cut off and never seen), a prompt of a very different
length is prefilled apart, and a policy cache is never padded."""
from __future__ import annotations

import pytest
import torch

from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.engine import PAD_WASTE
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
PROMPTS = [list(range(3, 14)), list(range(20, 32)), list(range(40, 50)), list(range(60, 100))]  # 11, 12, 10, 40


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    cfg = TinyConfig()
    path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", cfg, tiny_weights(cfg, seed=5))
    return load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS)


def engine(loaded, policy: str):
    return build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy.parse(policy), 400), OPTIONS).engine


def counting_forwards(eng) -> list[int]:
    """Rows × width of every model forward the engine runs from now on."""
    shapes, forward = [], eng.model.forward

    def counted(tokens, cache, **kw):
        shapes.append(tuple(tokens.shape))
        return forward(tokens, cache, **kw)
    eng.model.forward = counted
    return shapes


def alone(loaded, policy: str, history: list[int] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each prompt prefilled by itself in its own sequence (after ``history``), then one decode step."""
    eng = engine(loaded, policy)
    first, after = [], []
    for i, ids in enumerate(PROMPTS):
        eng.cache.add_sequence(i)
        if history:
            eng.prefill(i, history)
        first.append(eng.prefill(i, ids))
        after.append(eng.decode([i], [7])[0])
    return first, after


@pytest.mark.parametrize("policy", ["fp16", "fp16+sink4+win160"])
def test_prompts_prefilled_together_match_one_at_a_time(loaded, policy):
    history = list(range(100, 117))  # the sequences already hold tokens (a follow-up turn's slot)
    ref_first, ref_after = alone(loaded, policy, history)
    eng = engine(loaded, policy)
    for i in range(len(PROMPTS)):
        eng.cache.add_sequence(i)
        eng.prefill(i, history)
    shapes = counting_forwards(eng)
    first = eng.prefill_together(list(range(len(PROMPTS))), PROMPTS)
    if policy == "fp16":  # the three short prompts in one forward padded to 12; the long one alone
        assert 12 * 3 <= PAD_WASTE * (11 + 12 + 10) and sorted(shapes) == [(1, 40), (3, 12)]
    else:  # a policy cache is never padded
        assert sorted(shapes) == sorted((1, len(p)) for p in PROMPTS)
    for i, ids in enumerate(PROMPTS):
        assert eng.cache.length(i) == len(history) + len(ids)  # the pad is gone
        torch.testing.assert_close(first[i], ref_first[i], rtol=1e-4, atol=1e-4)
    after = eng.decode(list(range(len(PROMPTS))), [7] * len(PROMPTS))
    for i in range(len(PROMPTS)):  # the next token sees the prompt's K/V and nothing of the pad
        torch.testing.assert_close(after[i], ref_after[i], rtol=1e-4, atol=1e-4)


def test_a_lone_prompt_and_an_empty_one(loaded):
    eng = engine(loaded, "fp16")
    eng.cache.add_sequence(0)
    eng.cache.add_sequence(1)
    shapes = counting_forwards(eng)
    eng.prefill_together([0], [PROMPTS[0]])
    assert shapes == [(1, 11)]
    with pytest.raises(ValueError):
        eng.prefill_together([1], [[]])


def test_sequences_with_reserved_blocks_are_not_padded(loaded):
    """A batch reserves each sequence's blocks up front; the pad's blocks would leave the reservation."""
    eng = engine(loaded, "fp16")
    eng.cache.add_sequence(0, reserve_tokens=40)
    eng.cache.add_sequence(1)
    shapes = counting_forwards(eng)
    eng.prefill_together([0, 1], PROMPTS[:2])
    assert sorted(shapes) == [(1, 11), (1, 12)]
