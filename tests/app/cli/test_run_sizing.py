"""`localctx run` allocates the KV its request needs (prompt + --max-tokens, in llama.cpp's 256-cell
steps) unless --context asks for more, says so beside the plan's maximum (--json, the stats line),
and --timings says where its start-up time went."""
import json

import pytest
from gguf_tiny import ARCHS, write

pytest.importorskip("llama_cpp")

from localctx.backends.llamacpp.allocation import LlamaCppCache  # noqa: E402
from localctx.backends.models.spec_reader import gguf_spec  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write(tmp_path_factory.mktemp("run-sizing") / "llama.gguf", ARCHS["llama"])


def run_json(cli, tiny, *extra):
    res = cli("run", "-m", str(tiny), "--backend", "llamacpp", "--max-tokens", "4", "--json", *extra, "hello")
    assert res.code == 0, res.err
    return json.loads(res.out)


def test_run_allocates_the_request_and_reports_the_maximum(cli, tiny):
    spec = gguf_spec(tiny)
    out = run_json(cli, tiny)
    assert out["context"] == spec.context_length > 256
    assert out["allocated_context"] == 256  # 5 bytes + 128 template tokens + 4, in one 256-cell step
    assert out["allocated_kv_bytes"] == LlamaCppCache(256).bytes(spec)
    assert out["planned_kv_bytes"] == LlamaCppCache(spec.context_length).bytes(spec) > out["allocated_kv_bytes"]
    assert out["stats"]["generated_tokens"] >= 1


def test_a_larger_context_asked_for_is_allocated_whole(cli, tiny):
    spec = gguf_spec(tiny)
    out = run_json(cli, tiny, "--context", "1000")
    assert out["context"] == out["allocated_context"] == 1000
    assert out["allocated_kv_bytes"] == out["planned_kv_bytes"] == LlamaCppCache(1000).bytes(spec)


def test_stats_line_and_timings(cli, tiny):
    res = cli("run", "-m", str(tiny), "--backend", "llamacpp", "--max-tokens", "2", "--timings", "hello")
    assert res.code == 0, res.err
    stats, timings = res.err.strip().splitlines()[-2:]
    assert "allocated (256 tokens;" in stats and f"at {gguf_spec(tiny).context_length:,})" in stats
    assert timings.startswith("[timings (s): interpreter and imports ")
    for stage in ("header", "machine and backend profile", "plan", "load", "template", "template, prefill and first token"):
        assert f"{stage} " in timings
    out = run_json(cli, tiny, "--timings")
    assert {"header", "plan", "load", "template", "template, prefill and first token"} <= set(out["timings"])
    assert all(seconds >= 0 for seconds in out["timings"].values())


def test_the_stats_line_says_what_prompt_lookup_did():
    """An answer whose steps were all plain says so: it read "0.98 tok/step (0 of 0 drafted accepted)",
    the stop token's step counted against the tokens shown."""
    from localctx.app.commands.run import speculation_words
    from localctx.backends.base import GenerationStats
    plain = GenerationStats("llamacpp", "int8", speculate="ngram", generated_tokens=48, decode_steps=48)
    assert speculation_words(plain) == ", prompt lookup drafted nothing"
    copied = GenerationStats("llamacpp", "int8", speculate="ngram", generated_tokens=41, decode_steps=16,
                             drafted_tokens=30, accepted_tokens=24)
    assert speculation_words(copied) == ", prompt lookup 2.50 tok/step (24 of 30 drafted accepted)"
    refused = GenerationStats("llamacpp", "int8", speculate="off (heavy hitters)")
    assert speculation_words(refused) == ", prompt lookup off"
    assert speculation_words(GenerationStats("llamacpp", "int8")) == ""


def test_the_stats_line_says_how_much_of_the_prompt_came_from_the_prompt_cache(cli, tiny):
    """A long prompt's KV is kept on disk (kvcache/prompt_cache.py); a second run that starts the same way
    reads it back, and its stats line says how many tokens it read (its prefill figure is of the rest)."""
    text = "the tent in the sea and the hat on the mat " * 80  # well over the cache's 512 tokens
    first = cli("run", "-m", str(tiny), "--backend", "llamacpp", "--max-tokens", "2", text + "first?")
    assert first.code == 0, first.err
    assert "from the prompt cache" not in first.err
    again = cli("run", "-m", str(tiny), "--backend", "llamacpp", "--max-tokens", "2", "--json", text + "second?")
    stats = json.loads(again.out)["stats"]
    assert stats["loaded_tokens"] >= 512 and stats["loaded_tokens"] < stats["prompt_tokens"]
    again = cli("run", "-m", str(tiny), "--backend", "llamacpp", "--max-tokens", "2", text + "second?")
    assert f", {stats['loaded_tokens']:,} of {stats['prompt_tokens']:,} prompt tokens from the prompt cache, KV " in again.err


def test_no_prompt_cache_words_when_nothing_was_read():
    from localctx.app.commands.run import prompt_cache_words
    from localctx.backends.base import GenerationStats
    assert prompt_cache_words(GenerationStats("llamacpp", "fp16", prompt_tokens=900, cached_tokens=0)) == ""
    read = GenerationStats("llamacpp", "fp16", prompt_tokens=1_900, cached_tokens=1_536, loaded_tokens=1_536)
    assert prompt_cache_words(read) == ", 1,536 of 1,900 prompt tokens from the prompt cache"
