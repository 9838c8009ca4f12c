"""mlx-lm as the MLX backend's model zoo (backends/mlx/zoo.py, gguf_convert.py, lm_cache.py): GGUFs
converted with the reference's logits, the conversion cached and checked, folders written by mlx-lm's
own convert, an architecture only mlx-lm implements, localctx's policies inside mlx-lm's models with
the cost model's bytes, and the refusals the planner sees."""
import json
import os
import shutil
import stat

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX model zoo needs mlx-lm (pip install 'mlx-lm[cpu]' on Linux)")

import torch_tiny_models as tt  # noqa: E402
from localctx.backends.base import GenerationParams  # noqa: E402
from localctx.backends.mlx import zoo  # noqa: E402
from localctx.backends.mlx.backend import MLXBackend  # noqa: E402
from localctx.backends.mlx.gguf_convert import MANIFEST, converted_folder  # noqa: E402
from localctx.backends.mlx.lm_cache import LMCache  # noqa: E402
from localctx.backends.mlx.loading import LoadOptions  # noqa: E402
from localctx.backends.mlx.session import SessionOptions  # noqa: E402
from localctx.backends.models.ref import ModelRef  # noqa: E402
from localctx.backends.models.spec_reader import hf_spec, read_spec  # noqa: E402
from localctx.kvcache import cost, eviction  # noqa: E402
from localctx.kvcache.errors import UserError  # noqa: E402
from localctx.kvcache.plan import Plan  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

from test_mlx_backend import tiny_folder, tiny_session  # noqa: E402,F401,F811  (tiny_folder is a fixture)


def lm_logits(lm, ids):
    from mlx_lm.models.cache import make_prompt_cache

    return np.array(lm.model(mx.array(ids)[None], cache=make_prompt_cache(lm.model))[0].astype(mx.float32))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_gguf_converts_to_mlx_lm_with_the_reference_logits(tmp_path, arch, capsys):
    cfg = tt.TinyConfig(arch=arch, hidden=64, head_dim=16, intermediate=64)
    w = tt.tiny_weights(cfg)
    path = tt.write_gguf(tmp_path / "m.gguf", cfg, w)
    folder = converted_folder(path)
    assert "converted m.gguf for MLX" in capsys.readouterr().err
    ids = [5, 17, 42, 3, 99, 7, 61, 12]
    got, ref = lm_logits(zoo.load_folder(folder), ids), tt.reference_logits(cfg, w, ids).numpy()
    assert np.abs(got - ref).max() < 0.02 * np.abs(ref).max()  # float16 weights
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    # cached: the second load converts nothing; owner-only files
    assert converted_folder(path) == folder and "converted" not in capsys.readouterr().err
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in folder.iterdir())


def test_a_damaged_conversion_is_rebuilt_not_used(tmp_path, capsys):
    cfg = tt.TinyConfig(hidden=64, head_dim=16, intermediate=64)
    w = tt.tiny_weights(cfg)
    path = tt.write_gguf(tmp_path / "m.gguf", cfg, w)
    folder = converted_folder(path)
    capsys.readouterr()
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\xff" * 8
    weights.write_bytes(bytes(data))
    assert converted_folder(path) == folder and "converted" in capsys.readouterr().err
    ids = [5, 17, 42, 3]
    ref = tt.reference_logits(cfg, w, ids).numpy()
    assert (lm_logits(zoo.load_folder(folder), ids).argmax(-1) == ref.argmax(-1)).all()
    os.chmod(folder / MANIFEST, 0o666)  # a manifest others could have written is not trusted
    assert converted_folder(path) == folder and "converted" in capsys.readouterr().err


def test_a_gguf_of_an_unmapped_architecture_is_one_line_error(tmp_path):
    from localctx.backends.mlx.gguf_convert import config_from_gguf
    from localctx.backends.models.gguf_meta import ModelMeta

    class Header:
        def get(self, key, default=None):
            return {"general.architecture": "rwkv7"}.get(key, default)

    with pytest.raises(UserError, match="rwkv7.*llamacpp"):
        config_from_gguf(ModelMeta(Header(), "x.gguf"), set())


def greedy(session, ids, n):
    logits, out = session.feed(ids), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = session.feed([out[-1]])
    return out


def mlx_lm_greedy(folder, ids, n):
    """mlx-lm's own generation loop on the folder (the anchor)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
    return out


def folder_session(folder, kv="fp16", graph="mlx-lm", load=LoadOptions()):
    spec = hf_spec(folder)
    plan = Plan.fixed("mlx", spec, KVPolicy.parse(kv), None)
    return MLXBackend(SessionOptions(graph=graph, load=load)).load(ModelRef("hf", folder, folder.name, "folder"), plan), spec


def test_a_folder_written_by_mlx_lm_convert_runs(tiny_folder, tmp_path):  # noqa: F811
    from mlx_lm import convert

    source = shutil.copytree(tiny_folder, tmp_path / "hf")
    cfg = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))  # as every HF config has
    out = tmp_path / "mlx-q4"
    convert(str(source), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (out / name).exists():
            shutil.copy(tiny_folder / name, out / name)
    session, _ = folder_session(out, graph="auto", load=LoadOptions(dequantize=False))  # as mlx-lm runs it
    ids = session.tokenizer.encode("the cache keeps sinks")
    assert greedy(session, ids, 8) == mlx_lm_greedy(out, ids, 8)
    expanded, _ = folder_session(out, graph="auto", load=LoadOptions(dequantize=True))  # the same values
    np.testing.assert_allclose(expanded.feed(ids), session.reset() or session.feed(ids), atol=1e-3)


def write_phi3(folder, tiny_folder):  # noqa: F811
    """A random phi3 (an architecture localctx has no page for), built with mlx-lm's own classes."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import phi3

    cfg = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
           "vocab_size": 300, "max_position_embeddings": 512, "rope_theta": 10000.0, "torch_dtype": "float32"}
    mx.random.seed(3)
    model = phi3.Model(phi3.ModelArgs.from_dict(cfg))
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_folder / name, folder / name)
    return folder


def test_an_architecture_only_mlx_lm_implements_runs(tiny_folder, tmp_path):  # noqa: F811
    folder = write_phi3(tmp_path / "phi3", tiny_folder)
    spec = hf_spec(folder)
    assert spec.architecture == "phi3" and zoo.supports("phi3")
    session, _ = folder_session(folder, graph="auto")
    assert isinstance(session.cache, LMCache)
    ids = session.tokenizer.encode("the cache keeps sinks and a window")
    assert greedy(session, ids, 10) == mlx_lm_greedy(folder, ids, 10)
    # its refusals name the architecture and the reason, before any plan is made
    from localctx.backends.machine.planner_inputs import backend_view

    view, _ = backend_view("mlx", spec)  # what the planner filters candidates with
    reasons = view.refusals(KVPolicy.parse("int8+sink4+win64+heavy8"))
    assert any("phi3" in r and "attention weights" in r for r in reasons)
    assert not MLXBackend().refusals(KVPolicy.parse("int4+sink4+win64"), spec)


POLICIES = ["fp16", "int8", "int4+g32", "int8+res16", "int4+g32+res8", "fp16+sink2+win24", "int8+g32+sink2+win40"]


@pytest.mark.parametrize("kv", POLICIES)
def test_every_policy_runs_inside_an_mlx_lm_model_with_the_cost_models_bytes(tiny_folder, tmp_path, kv):  # noqa: F811
    folder = write_phi3(tmp_path / "phi3", tiny_folder)
    session, spec = folder_session(folder, kv)
    prompt = "the cache keeps sinks and a window of recent tokens " * 3
    done = list(session.generate(prompt, GenerationParams(max_tokens=20)))[-1]
    n = session.cache.n_seen
    assert done.stats.kv_bytes == cost.kv_bytes(spec, session.plan.policy, n) == session.cache.nbytes()
    assert done.stats.kv_tokens == eviction.held_counts(session.plan.policy, n).tokens
    # a chunked prefill attends exactly as feeding one token at a time
    ids = session.tokenizer.encode(prompt)
    one, _ = folder_session(folder, kv)
    one.options = SessionOptions(prefill_chunk=1)
    session.reset()
    np.testing.assert_allclose(session.feed(ids), one.feed(ids), atol=1e-4)


def test_the_mlx_lm_graph_matches_the_page_at_full_precision(tiny_folder):  # noqa: F811
    page, _ = tiny_session(tiny_folder, "fp16", graph="page")
    lm, _ = tiny_session(tiny_folder, "fp16", graph="mlx-lm")
    ids = page.tokenizer.encode("the cache keeps sinks and a window of recent tokens")
    np.testing.assert_allclose(lm.feed(ids), page.feed(ids), atol=1e-3)
    assert greedy(page, [7], 8) == greedy(lm, [7], 8)


def test_auto_takes_the_page_where_the_policy_needs_it(tiny_folder):  # noqa: F811
    spec = hf_spec(tiny_folder)
    assert zoo.graph_for(spec, KVPolicy.parse("int8"), "auto") == "mlx-lm"
    assert zoo.graph_for(spec, KVPolicy.parse("int8+sink4+win64+heavy8"), "auto") == "page"
    assert zoo.graph_for(spec, KVPolicy.parse("fp16+sink4+win64"), "auto") == "page"  # re-indexed past the window


def test_sliding_window_architectures_refuse_policies_with_the_reason(gemma3_path):
    spec = read_spec(ModelRef("gguf", gemma3_path, "gemma3", "file"))
    backend = MLXBackend()
    assert not backend.refusals(KVPolicy.parse("int8"), spec)  # the page runs Gemma 3 with every policy
    assert zoo.refusals(KVPolicy.parse("int8"), spec) and "sliding" in zoo.refusals(KVPolicy.parse("int8"), spec)[0]
    assert zoo.graph_for(spec, KVPolicy.parse("int8"), "auto") == "page"
    assert zoo.graph_for(spec, KVPolicy.parse("fp16"), "auto") == "mlx-lm"


@pytest.mark.parametrize("kv,graph", [("fp16", "mlx-lm"), ("int8+res16", "mlx-lm"), ("int4+g32+sink2+win40", "mlx-lm"),
                                      ("fp16", "page"), ("int8+sink2+win24", "page")])
def test_prompt_lookup_gives_plain_decodings_greedy_text(tiny_folder, tmp_path, kv, graph):  # noqa: F811
    """The random phi3 repeats the prompt's phrases, so drafts are made and accepted; the random
    llama (the page's model) does not, so there only the text is compared."""
    folder = write_phi3(tmp_path / "phi3", tiny_folder) if graph == "mlx-lm" else tiny_folder
    prompt = "the cache keeps sinks and a window of recent tokens; " * 4
    texts, stats = {}, {}
    for mode in ("off", "ngram"):
        session, _ = folder_session(folder, kv, graph=graph)
        events = list(session.generate(prompt, GenerationParams(max_tokens=24, speculate=mode)))
        texts[mode] = [e.token for e in events if e.kind == "token"]
        stats[mode] = events[-1].stats
    assert texts["ngram"] == texts["off"]
    assert stats["ngram"].speculate == "ngram"
    if graph == "mlx-lm":
        assert stats["ngram"].drafted_tokens > 0
        assert stats["ngram"].decode_steps < stats["off"].generated_tokens  # drafts were accepted


def test_a_failed_step_on_mlx_lms_own_caches_restarts_the_conversation(tiny_folder, tmp_path, monkeypatch):  # noqa: F811
    from localctx.backends.mlx.lm_cache import NativeCache

    folder = write_phi3(tmp_path / "phi3", tiny_folder)
    session, _ = folder_session(folder)
    session.cache = NativeCache(session.model.model, 512)  # as for a model with sliding layers
    ids = session.tokenizer.encode("the cache keeps sinks")
    want = greedy(session, ids, 3)
    session.reset()
    session.feed(ids)
    with monkeypatch.context() as m:
        m.setattr(session.model, "model", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory")))
        with pytest.raises(RuntimeError):
            session.feed([7])
    assert session.fed == [] and session.cache.n_seen == 0
    session.reset()
    assert greedy(session, ids, 3) == want
