"""One real measurement each of plain llama-cpp-python and localctx's llama.cpp backend on the bundled
SmolLM2 (tiny context): both read the same prompt, and the KV bytes agree with the cost model."""
from __future__ import annotations

import sys

import pytest

from localctx.app.bench.measure import MeasureRequest, measure
from localctx.app.bench.memory import PeakTracker
from localctx.backends.llamacpp.session import default_threads
from localctx.backends.models.spec_reader import read_spec
from localctx.backends.models.ref import resolve
from localctx.kvcache import cost
from localctx.kvcache.policy import FP16


@pytest.mark.slow
def test_baseline_and_llamacpp_fp16_read_the_same_prompt_and_report_cost_model_bytes(smollm2_path):
    spec = read_spec(resolve(str(smollm2_path)))
    common = dict(backend="llamacpp", policy="fp16", model=str(smollm2_path), context=96, gen_tokens=4,
                  threads=default_threads())
    tracker = PeakTracker()
    base = measure(MeasureRequest(baseline=True, **common), tracker)
    mine = measure(MeasureRequest(**common), tracker)
    for sample in (base, mine):
        assert sample.error is None
        assert sample.prompt_tokens <= 96 - 4 and sample.generated_tokens >= 1
        assert sample.prefill_tok_s > 0
        assert sample.kv_bytes == cost.kv_bytes(spec, FP16, sample.kv_tokens) > 0
        assert sample.peak_rss_bytes > spec.weight_bytes // 2  # the weights were paged in during the measurement
        if sys.platform == "linux":
            assert sample.peak_scope == "measurement"
    assert base.prompt_tokens == mine.prompt_tokens  # one corpus, one tokenizer: the same prompt


def test_a_backend_that_cannot_load_becomes_the_samples_error():
    sample = measure(MeasureRequest(backend="llamacpp", policy="fp16", model="fake", context=96, gen_tokens=4,
                                    threads=1), PeakTracker())
    assert sample.error and "GGUF" in sample.error
