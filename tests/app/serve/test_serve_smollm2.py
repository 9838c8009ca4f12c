"""localctx serve on the bundled SmolLM2 (llama.cpp, two batched slots), as a real subprocess of
the CLI: greedy whole and streamed answers agree, the follow-up turn reuses the cached prefix, a
prompt past a slot's context is refused with 400, and the plan is on /v1/models."""
from __future__ import annotations

import openai
import pytest

from serve_helpers import serve_subprocess

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def smollm2_server():
    with serve_subprocess(["--backend", "llamacpp", "--context", "1024", "--parallel", "2", "--kv", "int8",
                           "--kv-lanes", "60"]) as (proc, url):
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


def test_whole_and_streamed_greedy_answers_agree(smollm2_server):
    c = smollm2_server
    model = c.models.list().data[0]
    assert model.id == "SmolLM2-135M-Instruct"
    assert model.model_extra["localctx"]["plan"]["policy"] == "int8"
    assert model.model_extra["localctx"]["plan"]["kv_layout"].startswith("lossy: q8_0 keys and values")  # llama.cpp's words
    assert model.model_extra["localctx"]["trained_context"] == 8192
    whole = c.chat.completions.create(model=model.id, messages=QUESTION, max_tokens=12, temperature=0)
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=model.id, messages=QUESTION, max_tokens=12, temperature=0, stream=True) if ch.choices)
    assert text == whole.choices[0].message.content and text.strip()
    ext = whole.model_extra["localctx"]
    assert ext["policy"] == "int8" and ext["exact"] is False and ext["kv_bytes"] > 0


def test_a_follow_up_turn_reuses_the_cached_prefix(smollm2_server):
    c = smollm2_server
    first = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=8,
                                      temperature=0)
    follow = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And one more?"}]
    second = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=follow, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_a_prompt_past_the_context_is_refused(smollm2_server):
    with pytest.raises(openai.BadRequestError) as bad:
        smollm2_server.chat.completions.create(model="SmolLM2-135M-Instruct",
                                               messages=[{"role": "user", "content": "colour " * 600}])
    msg = bad.value.body["message"]
    assert bad.value.body["code"] == "context_length_exceeded" and "context holds 512" in msg  # 1,024 over 2 slots
    assert "2 slots" in msg


def test_a_request_policy_gets_a_lane_and_what_llama_cpp_cannot_run_is_refused(smollm2_server):
    c = smollm2_server
    with pytest.raises(openai.BadRequestError) as bad:  # fp16 at the served 1,024 tokens: twice int8's bytes
        c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=4,
                                  extra_body={"localctx": {"kv": "fp16"}})
    assert bad.value.body["code"] == "kv_budget_exceeded"
    fp16 = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=8, temperature=0,
                                     extra_body={"localctx": {"kv": "fp16", "context": 512}})
    ext = fp16.model_extra["localctx"]
    assert ext["policy"] == "fp16" and ext["exact"] is True and ext["context"] == 512
    assert ext["kv_layout"].startswith("exact") and fp16.choices[0].message.content.strip()
    for kv, reason in (("int4+res128", "residual"), ("fp16+sink4+win512", "context shift")):
        with pytest.raises(openai.BadRequestError) as bad:
            c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=4,
                                      extra_body={"localctx": {"kv": kv}})
        assert bad.value.body["code"] == "kv_policy_unavailable" and reason in bad.value.body["message"]
    lanes = c.models.list().data[0].model_extra["localctx"]["lanes"]
    assert [(lane["policy"], lane["context"]) for lane in lanes] == [("fp16", 512)]  # int8 (idle) made room
    again = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=4)
    assert again.model_extra["localctx"]["policy"] == "int8"
