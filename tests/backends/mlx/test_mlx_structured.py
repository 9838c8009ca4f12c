"""Structured output on the MLX backend (llguidance through backends/mlx/sampling.py): on a tiny
random-weight folder model (its vocabulary smaller than its logits) and on SmolLM2's GGUF (llama.cpp's
vocabulary), answers sampled under a schema validate against it."""
import json

import jsonschema
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends.base import GenerationParams, OutputConstraint  # noqa: E402
from localctx.backends.mlx.backend import MLXBackend  # noqa: E402
from localctx.backends.models.ref import ModelRef, bundled_default_path  # noqa: E402
from localctx.backends.models.spec_reader import read_spec  # noqa: E402
from localctx.kvcache.plan import Plan  # noqa: E402
from localctx.kvcache.policy import KVPolicy  # noqa: E402

from test_mlx_backend import TINY, tiny_session, write_tiny_folder  # noqa: E402

ANSWER = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tags"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["sink", "window"]}, "maxItems": 2}}}
ASK = [{"role": "user", "content": "the cache keeps sinks"}]


def params(seed, temperature=1.0):
    return GenerationParams(max_tokens=120, temperature=temperature, seed=seed,
                            constraint=OutputConstraint.json_schema(json.dumps(ANSWER)))


def answer(session, p) -> str:
    events = list(session.generate(ASK, p))
    assert events[-1].finish_reason == "stop"
    return "".join(e.text for e in events)


def test_tiny_random_model_answers_validate(tmp_path):
    session, _ = tiny_session(write_tiny_folder(tmp_path / "model", TINY), context=512)
    assert session.constraint_refusal(params(0).constraint) is None
    assert "llguidance cannot compile" in session.constraint_refusal(OutputConstraint.json_schema('{"not": {}}'))
    for seed, temperature in ((None, 0.0), (1, 1.0), (2, 1.5)):
        jsonschema.validate(json.loads(answer(session, params(seed, temperature))), ANSWER)


@pytest.mark.slow
def test_smollm2_gguf_answers_validate():
    ref = ModelRef("gguf", bundled_default_path(), "SmolLM2", "file")
    spec = read_spec(ref)
    session = MLXBackend().load(ref, Plan.fixed("mlx", spec, KVPolicy.parse("fp16"), 1024))
    for seed in (None, 3):
        jsonschema.validate(json.loads(answer(session, params(seed, 0.0 if seed is None else 1.0))), ANSWER)
