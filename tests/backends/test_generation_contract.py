"""The generation contract, on the fake backend that the surfaces' tests use."""
import json

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.kvcache import cost


def _text(session, prompt, params):
    events = list(session.generate(prompt, params))
    return "".join(e.text for e in events), events


def test_same_seed_same_text_and_other_seed_other_text():
    s = open_session(SessionRequest(model=None, backend="fake"))
    p = GenerationParams(max_tokens=30, temperature=0.8, seed=7)
    a, _ = _text(s, "tell me", p)
    s.reset()
    b, _ = _text(s, "tell me", p)
    s.reset()
    c, _ = _text(s, "tell me", GenerationParams(max_tokens=30, temperature=0.8, seed=8))
    assert a == b and a != c


def test_multi_turn_reuses_the_cached_prefix():
    s = open_session(SessionRequest(model=None, backend="fake"))
    turn1 = [{"role": "user", "content": "hello there"}]
    reply, events = _text(s, turn1, GenerationParams(max_tokens=8))
    first = events[-1].stats
    assert first.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    _, events = _text(s, turn2, GenerationParams(max_tokens=8))
    assert events[-1].stats.cached_tokens >= first.prompt_tokens


def test_kv_bytes_in_events_equal_the_cost_model():
    s = open_session(SessionRequest(model=None, backend="fake", kv="int4+res16+sink4+win64"))
    _, events = _text(s, "one two three " * 40, GenerationParams(max_tokens=20))
    for e in events:
        n_stream = e.stats.prompt_tokens + e.stats.generated_tokens
        assert e.stats.kv_bytes == cost.kv_bytes(s.spec, s.plan.policy, n_stream)
    assert events[-1].stats.evicted_tokens > 0


def test_run_json_has_a_fixed_shape(cli):
    res = cli("run", "--backend", "fake", "--json", "--max-tokens", "5", "hello world")
    assert res.code == 0
    out = json.loads(res.out)
    assert set(out) == {"text", "finish_reason", "backend", "policy", "exact", "model", "kv_layout", "planned_kv_bytes",
                        "context", "allocated_context", "allocated_kv_bytes", "stats"}
    assert out["allocated_context"] <= out["context"]  # the request's KV, not the trained context's
    assert set(out["stats"]) >= {"prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s",
                                 "kv_bytes", "policy", "backend"}
    assert out["backend"] == "fake" and out["policy"] == "fp16" and out["exact"] is True
    assert out["kv_layout"] == "exact: full-precision KV" and out["planned_kv_bytes"] > 0
    assert out["stats"]["generated_tokens"] == 5 and out["finish_reason"] == "length"


def test_run_streams_text_to_stdout_and_one_stats_line_to_stderr(cli):
    res = cli("run", "--backend", "fake", "--kv", "int8", "what is up")
    assert res.code == 0
    assert res.out.startswith("Reply: what is up")
    lines = res.err.strip().splitlines()
    assert len(lines) == 1
    for part in ("prompt tokens", "generated", "prefill", "decode", "tok/s", "KV", "policy int8 (lossy)",
                 "backend fake"):
        assert part in lines[0]


def test_stdin_comes_first_then_the_argument(cli):
    res = cli("run", "--backend", "fake", "--json", "Summarise:", stdin="report body")
    assert json.loads(res.out)["text"].startswith("Reply: report body Summarise:")


def test_stop_strings_are_honoured_by_the_cli(cli):
    res = cli("run", "--backend", "fake", "--json", "--stop", "is", "what is up")
    out = json.loads(res.out)
    assert out["text"] == "Reply: what " and out["finish_reason"] == "stop"
