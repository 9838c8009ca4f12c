"""--backend mlx through the Session contract: generation, cache reuse, byte accounting,
refusals and user errors (tiny random model with a real tokenizer), and the CLI on SmolLM2."""
import json
import threading

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends import registry  # noqa: E402
from localctx.backends.base import GenerationParams  # noqa: E402
from localctx.backends.mlx.backend import MLXBackend, held_in_compute_dtype  # noqa: E402
from localctx.backends.mlx.session import SessionOptions  # noqa: E402
from localctx.backends.models.spec_reader import hf_spec  # noqa: E402
from localctx.backends.models.ref import ModelRef  # noqa: E402
from localctx.kvcache import cost  # noqa: E402
from localctx.kvcache.errors import UserError  # noqa: E402
from localctx.kvcache.plan import Plan  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

from test_mlx_loading import CONFIG, write_hf_folder  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 300  # the byte-level alphabet (256) + specials + a few merges
TINY = {**CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": VOCAB}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("tiny") / "model", TINY)


def write_tiny_folder(path, config):
    """A random-weight model folder of ``config`` with a small trained BPE tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    folder = write_hf_folder(path, config=config)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cache keeps sinks and a window of recent tokens"] * 20, trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>", "add_bos_token": False}))
    return folder


def tiny_session(folder, kv="fp16", context=None, graph="auto"):
    """``graph``: "page" (localctx's llama.py), "mlx-lm" (mlx-lm's llama) or "auto" (zoo.graph_for)."""
    ref = ModelRef("hf", folder, "tiny", "folder")
    spec = hf_spec(folder)
    backend = MLXBackend(SessionOptions(graph=graph))
    return backend.load(ref, Plan.fixed("mlx", spec, KVPolicy.parse(kv), context)), spec


def _events(session, prompt, **kw):
    return list(session.generate(prompt, GenerationParams(**{"max_tokens": 6, **kw})))


def test_registry_finds_the_mlx_backend():
    backend = registry.get("mlx")
    caps = backend.capabilities()
    assert caps.kv_bits == {16, 8, 4} and caps.residual and caps.sinks_window and caps.heavy
    assert any("Metal" in n for n in caps.notes)
    for text in ("fp16", "int8", "int4+res128", "int4+g64+sink4+win4096+heavy64"):
        assert backend.refusals(KVPolicy.parse(text)) == []


@pytest.mark.parametrize("kv", ["fp16", "int4+res8", "int8+sink2+win20+heavy4"])
def test_generation_streams_and_reports_exact_kv_bytes(tiny_folder, kv):
    session, spec = tiny_session(tiny_folder, kv)
    events = _events(session, [{"role": "user", "content": "the cache keeps sinks " * 6}], max_tokens=8)
    done = events[-1]
    assert done.kind == "done" and all(e.kind == "token" for e in events[:-1])
    assert done.finish_reason in ("stop", "length")
    assert done.stats.kv_bytes == cost.kv_bytes(spec, session.plan.policy, session.cache.n_seen)
    assert done.stats.kv_tokens == session.plan.policy.kept_tokens(session.cache.n_seen)
    assert done.stats.evicted_tokens == session.cache.n_seen - done.stats.kv_tokens
    assert spec.kv_elem_bytes == 4  # a float32 model keeps a float32 full-precision cache
    assert session.decode_threads == (1 if mx.metal.is_available() else None)  # MLX's CPU ops take every core


@pytest.mark.parametrize("kv", ["fp16", "int8+res8"])
def test_follow_up_reuses_the_cached_prefix_and_matches_a_fresh_run(tiny_folder, kv):
    session, _ = tiny_session(tiny_folder, kv)
    first = "the cache keeps sinks"
    _events(session, first)
    longer = first + " and a window"
    events = _events(session, longer)
    assert events[-1].stats.cached_tokens > 0
    fresh, spec = tiny_session(tiny_folder, kv)
    again = _events(fresh, longer)
    assert events[-1].stats.kv_bytes == again[-1].stats.kv_bytes
    assert [e.token for e in events] == [e.token for e in again]


def test_rollback_is_refused_where_it_would_not_be_exact(tiny_folder):
    session, _ = tiny_session(tiny_folder, "fp16+sink2+win4")
    _events(session, "the cache keeps sinks and a window", max_tokens=2)
    assert not session.cache.truncate(3)  # tokens were evicted: the prefix state is gone
    events = _events(session, "the cache keeps")
    assert events[-1].stats.cached_tokens == 0


def test_same_prompt_twice_reuses_everything(tiny_folder):
    session, _ = tiny_session(tiny_folder)
    a = _events(session, "the cache keeps", max_tokens=1)
    b = _events(session, "the cache keeps", max_tokens=1)
    assert b[-1].stats.cached_tokens == b[-1].stats.prompt_tokens
    assert a[0].token == b[0].token


def test_seeded_sampling_is_reproducible(tiny_folder):
    session, _ = tiny_session(tiny_folder)
    runs = [[e.token for e in _events(session, "the window", temperature=1.5, seed=7, top_k=20)] for _ in range(2)]
    assert runs[0] == runs[1]


def test_cancel_stops_between_tokens(tiny_folder):
    session, _ = tiny_session(tiny_folder)
    cancel = threading.Event()
    cancel.set()
    events = list(session.generate("the cache", GenerationParams(max_tokens=5), cancel))
    assert events[-1].finish_reason == "cancelled"


def test_windowed_policy_streams_past_the_context(tiny_folder):
    session, _spec = tiny_session(tiny_folder, "fp16+sink2+win8", context=16)
    events = _events(session, "the cache keeps sinks and a window of recent tokens " * 3, max_tokens=4)
    assert events[-1].stats.prompt_tokens > 16
    assert events[-1].stats.kv_tokens == 10


def test_prompt_longer_than_an_exact_context_is_refused(tiny_folder):
    session, _ = tiny_session(tiny_folder, "fp16", context=16)
    with pytest.raises(UserError, match="context holds 16"):
        _events(session, "the cache keeps sinks and a window of recent tokens " * 3)


def test_answer_is_capped_at_the_context_for_unbounded_caches(tiny_folder):
    session, _ = tiny_session(tiny_folder, "fp16", context=16)
    events = _events(session, "the cache", max_tokens=100)
    assert events[-1].stats.prompt_tokens + events[-1].stats.generated_tokens <= 16


def test_group_size_that_does_not_divide_the_head_is_refused(tiny_folder, tmp_path):
    assert MLXBackend().refusals(KVPolicy.parse("int4+g64"), hf_spec(tiny_folder))  # head dim 32
    narrow = write_hf_folder(tmp_path / "narrow")  # head dim 16
    reasons = MLXBackend().refusals(KVPolicy.parse("int4"), hf_spec(narrow))
    assert reasons and "head dim 16" in reasons[0]
    with pytest.raises(UserError, match="group size"):
        tiny_session(narrow, "int4")


def test_fake_model_is_refused_with_a_reason():
    with pytest.raises(UserError, match="GGUF files and safetensors folders"):
        MLXBackend().load(ModelRef("fake", None, "fake", "builtin"), None)


@pytest.mark.slow
def test_cli_run_on_smollm2_reports_planned_bytes(capsys, monkeypatch):
    import io
    from localctx.app.cli import main
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    from localctx.backends.models.spec_reader import gguf_spec
    from localctx.backends.models.ref import bundled_default_path
    code = main(["run", "--backend", "mlx", "--kv", "int4+res16+sink4+win64", "--max-tokens", "6", "--json",
                 "Name a colour."])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["backend"] == "mlx" and out["text"].strip()
    stats = out["stats"]
    spec = held_in_compute_dtype(gguf_spec(bundled_default_path()))  # full precision: the dtype MLX computes in
    n_seen = stats["prompt_tokens"] + stats["generated_tokens"] - (1 if out["finish_reason"] == "length" else 0)
    assert stats["kv_bytes"] == cost.kv_bytes(spec, KVPolicy.parse("int4+res16+sink4+win64"), n_seen)
    assert np.isfinite(stats["decode_tok_s"])
