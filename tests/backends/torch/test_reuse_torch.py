"""Reuse on the torch engine (tiny random-weight model): the prompt cache on disk round-trips every
cache format bit-exactly and its files hold the cost model's KV bytes plus a small header; a file
for another model or policy is never used; an edited middle message reuses the prefix before it."""
from __future__ import annotations

import pytest
import torch

from localctx.backends.base import GenerationParams
from localctx.backends.models.ref import ModelRef
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache import cost, prompt_cache, prompt_cache_file
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.prompt_cache import CHUNK
from torch_tiny_models import TinyConfig, tiny_weights, write_gguf

OPTIONS = TorchOptions(device="cpu", dtype=torch.float32, block_size=8)
CFG = TinyConfig(hidden=64, n_heads=2, n_kv_heads=1, head_dim=32, context=4096)  # int4 needs 32-wide groups


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reuse")
    return [write_gguf(folder / f"tiny{seed}.gguf", CFG, tiny_weights(CFG, seed=seed)) for seed in (3, 4)]


@pytest.fixture(scope="module")
def loaded(model_files):
    return [load_model(ModelRef("gguf", path, "tiny", "file"), OPTIONS) for path in model_files]


def session_for(loaded_model, path, policy: str, cached: bool = True):
    s = build_session(loaded_model, Plan.fixed("torch", loaded_model.spec, KVPolicy.parse(policy), 3000), OPTIONS)
    if cached:
        assert s.enable_prompt_cache(path) is None
    return s


DOC = " ".join(f"the hat {i % 7} in the tent; the sea" for i in range(60))  # about 1,150 tokens: two whole chunks


def answer(session, question: str, n: int = 12):
    events = list(session.generate(DOC + "\n" + question, GenerationParams(max_tokens=n)))
    return [e.token for e in events if e.kind == "token"], events[-1].stats


@pytest.mark.parametrize("policy", ["fp16", "int4", "int8+res64", "int4+sink4+win512", "fp16+sink4+win700"])
def test_a_second_question_loads_the_document_from_disk_and_answers_as_a_cold_run(loaded, model_files, policy):
    cold_tokens, cold = answer(session_for(loaded[0], model_files[0], policy, cached=False), "and the hat?")
    _, first = answer(session_for(loaded[0], model_files[0], policy), "where is the sea?")
    assert first.loaded_tokens == 0
    [entry] = prompt_cache.entries()
    n_file = int(entry.meta["n_tokens"])
    hit_session = session_for(loaded[0], model_files[0], policy)
    ids1, ids2 = (hit_session.tokenize(DOC + "\n" + q) for q in ("where is the sea?", "and the hat?"))
    common = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    if KVPolicy.parse(policy).exact:  # the paged cache: all but the last token saved, cut where the prompts differ
        assert n_file == first.prompt_tokens - 1 and common % CHUNK
        used = common
    else:  # quantized groups or a window: saved at the last chunk boundary, used whole
        assert n_file == (first.prompt_tokens - 1) // CHUNK * CHUNK == 2 * CHUNK
        used = n_file
    hit_tokens, hit = answer(hit_session, "and the hat?")
    assert hit.loaded_tokens == used and hit.cached_tokens == used
    assert hit_tokens == cold_tokens
    # the file: the cost model's KV bytes + the token list + a small header
    header, data_start = prompt_cache_file.read_header(entry.path)
    spec, pol = hit_session.spec, KVPolicy.parse(policy)  # an fp32 cache on CPU here
    n_seen_bytes = 16 if not pol.exact else 0
    assert entry.size == data_start + cost.kv_bytes(spec, pol, n_file) + 4 * n_file + n_seen_bytes
    assert data_start < 4096


def test_an_int4_file_stays_quantized(loaded, model_files):
    sizes = {}
    for policy in ("fp16", "int4"):
        answer(session_for(loaded[0], model_files[0], policy), "where is the sea?")
        sizes[policy] = max(e.size for e in prompt_cache.entries() if e.meta["scope_policy"] == policy)
    # the CPU cache here is fp32 (32 bits a value); int4 holds 4-bit codes plus fp16 scale and min per
    # 32 values (5 bits), with the first group in full precision: under a fifth, where fp16 would be a third
    assert sizes["int4"] < sizes["fp16"] / 5


def test_a_file_for_another_model_or_policy_is_not_used(loaded, model_files):
    answer(session_for(loaded[0], model_files[0], "int4"), "where is the sea?")
    _, other_model = answer(session_for(loaded[1], model_files[1], "int4"), "and the hat?")
    _, other_policy = answer(session_for(loaded[0], model_files[0], "int8"), "and the hat?")
    assert other_model.loaded_tokens == 0 and other_policy.loaded_tokens == 0
    _, same = answer(session_for(loaded[0], model_files[0], "int4"), "and the hat?")
    assert same.loaded_tokens > 0


@pytest.mark.parametrize("policy", ["fp16", "fp16+sink4+win2000", "int8+res2000"])
def test_an_edited_middle_message_reuses_the_prefix_before_it(loaded, model_files, policy):
    s = session_for(loaded[0], model_files[0], policy, cached=False)
    turns = [{"role": "user", "content": "the hat in the tent " * 20},
             {"role": "assistant", "content": "the sea " * 10},
             {"role": "user", "content": "and the tent in the sea? " * 5},
             {"role": "assistant", "content": "in the hat " * 10},
             {"role": "user", "content": "the end"}]
    list(s.generate(turns, GenerationParams(max_tokens=4)))
    edited = [dict(t) for t in turns]
    edited[2]["content"] = "and the hat on the sea? " * 5
    old, new = s.tokenize(turns), s.tokenize(edited)
    common = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    events = list(s.generate(edited, GenerationParams(max_tokens=4)))
    stats = events[-1].stats
    assert stats.cached_tokens == common  # only the tokens from the edit on were prefilled again
    fresh = session_for(loaded[0], model_files[0], policy, cached=False)
    assert [e.token for e in events if e.kind == "token"] == \
        [e.token for e in fresh.generate(edited, GenerationParams(max_tokens=4)) if e.kind == "token"]
