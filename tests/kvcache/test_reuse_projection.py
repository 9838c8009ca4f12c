"""The planner's time-to-first-token projection with a cached prefix, and `localctx plan --prompt-tokens`."""
from __future__ import annotations

import json

import pytest

from localctx.backends.machine import detect
from localctx.kvcache import cost
from localctx.kvcache.known_models import known_spec
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.reuse_projection import FILE_READ_BYTES_S, projected_ttft
from localctx.kvcache.speed import SpeedModel

SMOL = known_spec("smollm2-135m")
SPEED = SpeedModel(detect.named("cpu-24gb"))


def test_a_cached_prefix_leaves_the_suffix_prefill_and_the_file_read():
    cold = projected_ttft(SPEED, SMOL, KVPolicy(), 8192)
    warm = projected_ttft(SPEED, SMOL, KVPolicy(), 8192, 7680, from_file=True)
    assert cold.cached_tokens == 0 and cold.load_s == 0
    assert warm.load_s == pytest.approx(cost.kv_bytes(SMOL, KVPolicy(), 7680) / FILE_READ_BYTES_S)
    # the suffix's share of FLOPs: more than its share of tokens (it attends over the prefix), far less than all
    assert 512 / 8192 < warm.prefill_s / cold.prefill_s < 0.2
    int4 = projected_ttft(SPEED, SMOL, KVPolicy.parse("int4"), 8192, 7680, from_file=True)
    assert int4.load_s < warm.load_s / 3  # an int4 file is about a quarter of an fp16 one


def test_plan_prints_cold_and_cached_time_to_first_token_and_the_decode_note(cli):
    out = cli("plan", "-m", "smollm2-135m", "--hardware", "cpu-24gb", "--prompt-tokens", "8192", "--json")
    assert out.code == 0, out.err
    data = json.loads(out.out)
    cold, warm = data["ttft"]
    assert warm["cached_tokens"] == 7680 and warm["ttft_s"] < cold["ttft_s"]
    assert "prompt lookup" in data["decode_note"]
    bad = cli("plan", "-m", "smollm2-135m", "--hardware", "cpu-24gb", "--prompt-tokens", "100", "--cached-tokens", "100")
    assert bad.code != 0 and "--cached-tokens" in bad.err
