"""Reuse on --backend mlx (tiny random model, real tokenizer): an edited middle message keeps the
prefix before it, and the prompt cache on disk answers a second question about a document as a
cold run does, from a file of the cache's own bytes (quantized stays quantized, a window keeps
its stream positions and heavy-hitter scores)."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends.base import GenerationParams  # noqa: E402
from localctx.kvcache import cost, prompt_cache  # noqa: E402
from localctx.kvcache.prompt_cache import CHUNK  # noqa: E402

from test_mlx_backend import TINY, tiny_session, write_tiny_folder  # noqa: E402

LONG = {**TINY, "max_position_embeddings": 2048}
WORDS = "the cache keeps sinks and a window of recent tokens".split()


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("tiny-long") / "model", LONG)


def tokens_of(session, prompt, n=6):
    events = list(session.generate(prompt, GenerationParams(max_tokens=n)))
    return [e.token for e in events if e.kind == "token"], events[-1].stats


def test_an_edited_middle_message_reuses_the_prefix_before_it(long_folder):
    turns = [{"role": "user", "content": "the cache keeps sinks"},
             {"role": "assistant", "content": "and a window"},
             {"role": "user", "content": "of recent tokens"},
             {"role": "assistant", "content": "the window keeps"},
             {"role": "user", "content": "the sinks"}]
    edited = [dict(t) for t in turns]
    edited[2]["content"] = "of a cache"
    s, _ = tiny_session(long_folder, "fp16")
    tokens_of(s, turns, n=2)
    old, new = s.tokenizer.encode(s.render(turns)), s.tokenizer.encode(s.render(edited))
    common = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    again, stats = tokens_of(s, edited)
    assert stats.cached_tokens == common > 0
    fresh, _ = tiny_session(long_folder, "fp16")
    assert tokens_of(fresh, edited)[0] == again


def document(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


@pytest.mark.parametrize("kv,graph", [("fp16", "mlx-lm"), ("int4+res32", "mlx-lm"), ("int8+sink4+win300", "mlx-lm"),
                                      ("int4+res32", "page"), ("int8+sink4+win300+heavy32", "page")])
def test_a_second_question_loads_the_document_from_disk_and_answers_as_a_cold_run(long_folder, kv, graph):
    """On mlx-lm's model (keys cached rotated) and on the page (keys before RoPE) alike."""
    doc = document(700, seed=1)
    q1 = [{"role": "user", "content": doc + " the cache"}]
    q2 = [{"role": "user", "content": doc + " a window of"}]
    cold, _ = tiny_session(long_folder, kv, graph=graph)
    want, _ = tokens_of(cold, q2)
    first, spec = tiny_session(long_folder, kv, graph=graph)
    assert first.enable_prompt_cache(long_folder / "model.safetensors") is None
    _, stats1 = tokens_of(first, q1, n=1)
    [entry] = prompt_cache.entries()
    n_file = int(entry.meta["n_tokens"])
    assert n_file == (stats1.prompt_tokens - 1) // CHUNK * CHUNK >= CHUNK
    second, _ = tiny_session(long_folder, kv, graph=graph)
    second.enable_prompt_cache(long_folder / "model.safetensors")
    got, stats2 = tokens_of(second, q2)
    assert stats2.loaded_tokens == stats2.cached_tokens == n_file
    assert got == want
    for a, b in zip(cold.cache.layers, second.cache.layers):  # the same tokens kept, the same scores
        assert np.array_equal(a.kept_ids(), b.kept_ids())
        mass = [np.sort(np.concatenate([layer.q_mass, layer.f_mass])) for layer in (a, b)]
        assert np.array_equal(*mass)
    assert np.array_equal(cold.last_logits, second.last_logits)
    held = int(entry.meta["kv_bytes"])
    if not second.plan.policy.evicts:  # the cost model's bytes, quantized groups as held, plus the header
        assert held == cost.kv_bytes(spec, second.plan.policy, n_file)
        assert 0 < entry.size - held < 16384
    else:  # stream indices and attention mass ride along for the evicting window
        assert held == cost.kv_bytes(spec, second.plan.policy, n_file) and entry.size > held


def test_a_folder_model_keeps_no_prompt_cache(long_folder):
    s, _ = tiny_session(long_folder, "fp16")
    assert "folder" in s.enable_prompt_cache(long_folder)


@pytest.mark.parametrize("kv", ["fp16", "int4+res8"])
def test_a_cache_with_sliding_layers_goes_through_a_file_and_decodes_on_as_before(tmp_path, kv):
    """Tiny Gemma 3 (five layers sliding over 4 tokens, one global): layers of different lengths,
    sliding ones with stream indices written, quantized groups as held."""
    from gemma3_tiny import VOCAB, mlx_model, tiny_tensors

    from localctx.backends.mlx import prompt_cache as mlx_prompt_cache
    from localctx.backends.mlx.policy_cache import CacheShape, ModelCache
    from localctx.kvcache import prompt_cache_file
    from localctx.kvcache.policy import KVPolicy
    from localctx.kvcache.prompt_cache import Hit

    model = mlx_model(tiny_tensors())
    a = model.args

    def new_cache():
        return ModelCache(KVPolicy.parse(kv), a.n_layers, CacheShape(a.n_kv_heads, a.head_dim, mx.float32, False),
                          a.inv_freqs(), a.layer_windows)

    tokens = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 104)]
    first = new_cache()
    model(mx.array(tokens[:96], dtype=mx.int32), first)
    tensors = mlx_prompt_cache.export(first)
    assert "0.f_ids" in tensors and "5.q_start" in tensors  # a sliding layer evicted; the global one did not
    assert ("5.k_codes" in tensors) == (kv != "fp16")
    path = tmp_path / "c.safetensors"
    prompt_cache_file.write(path, dict(tensors, tokens=np.asarray(tokens[:96], np.int32)), {})
    second = new_cache()
    mlx_prompt_cache.load(second, Hit(prompt_cache_file.read(path), 96))
    assert second.nbytes() == first.nbytes()
    for t in tokens[96:]:
        want = np.array(model(mx.array([t], dtype=mx.int32), first))
        got = np.array(model(mx.array([t], dtype=mx.int32), second))
        assert np.array_equal(got, want)
    kept = [[layer.kept_ids().tolist() for layer in cache.layers] for cache in (first, second)]
    assert kept[0] == kept[1]
