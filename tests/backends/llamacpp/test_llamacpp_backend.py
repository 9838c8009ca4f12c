"""The llama.cpp backend on the real bundled SmolLM2."""
import subprocess
import sys
import threading

import numpy as np
import pytest

from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.kvcache import cost

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def session():
    s = open_session(SessionRequest(model=None, backend="llamacpp", context=1024))
    yield s
    s.close()


def _gen(session, prompt, params, cancel=None):
    session.reset()
    events = list(session.generate(prompt, params, cancel))
    return "".join(e.text for e in events), events


def test_next_token_logits_match_an_independent_numpy_forward(session, smollm2_path):
    from reference_llama_numpy import NumpyLlama

    ours = session.next_token_logits(CHAT)
    ref = NumpyLlama(str(smollm2_path)).logits(session.tokenize(CHAT))
    assert np.corrcoef(ours, ref)[0, 1] >= 0.99
    assert set(np.argsort(-ours)[:5]) == set(np.argsort(-ref)[:5])


def test_chat_template_comes_from_the_model(session):
    ids = session.tokenize(CHAT)
    text = session.llm.detokenize(ids, special=True).decode()
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


def test_same_seed_gives_the_same_text(session):
    p = GenerationParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    a, _ = _gen(session, CHAT, p)
    b, _ = _gen(session, CHAT, p)
    c, _ = _gen(session, CHAT, GenerationParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=12))
    assert a == b
    assert a != c


def test_greedy_is_deterministic_and_max_tokens_is_exact(session):
    text, events = _gen(session, CHAT, GenerationParams(max_tokens=6))
    again, _ = _gen(session, CHAT, GenerationParams(max_tokens=6))
    assert text == again and text.strip()
    assert events[-1].stats.generated_tokens == 6 and events[-1].finish_reason == "length"


def test_stop_string_cuts_the_answer_before_it(session):
    full, _ = _gen(session, CHAT, GenerationParams(max_tokens=12))
    stop = full.split()[2]
    text, events = _gen(session, CHAT, GenerationParams(max_tokens=12, stop=(stop,)))
    assert text == full[:full.index(stop)]
    assert events[-1].finish_reason == "stop"


def test_quantized_kv_bytes_use_llama_cpp_block_sizes():
    s = open_session(SessionRequest(model=None, backend="llamacpp", context=256, kv="int8"))
    with s:
        events = list(s.generate(CHAT, GenerationParams(max_tokens=2)))
    # q8_0: 34 bytes per 32 elements, K and V, 30 layers x 3 KV heads x 64 dims
    assert events[-1].stats.kv_bytes == events[-1].stats.kv_tokens * 2 * 30 * (192 // 32 * 34)


def test_kv_bytes_read_back_equal_the_cost_model(session):
    _, events = _gen(session, CHAT, GenerationParams(max_tokens=5))
    for e in events:
        assert e.stats.kv_tokens > 0
        assert e.stats.kv_bytes == cost.kv_bytes(session.spec, session.plan.policy, e.stats.kv_tokens)


def test_second_turn_reuses_the_cache(session):
    text, events = _gen(session, CHAT, GenerationParams(max_tokens=12))
    turn2 = CHAT + [{"role": "assistant", "content": text}, {"role": "user", "content": "And of Spain?"}]
    events2 = list(session.generate(turn2, GenerationParams(max_tokens=4)))
    assert events2[-1].stats.cached_tokens >= events[-1].stats.prompt_tokens - 1


def test_cancel_stops_between_tokens(session):
    cancel = threading.Event()
    session.reset()
    seen = []
    for e in session.generate(CHAT, GenerationParams(max_tokens=50), cancel):
        seen.append(e)
        if len(seen) == 3:
            cancel.set()
    assert seen[-1].finish_reason == "cancelled"
    assert seen[-1].stats.generated_tokens == 3


def test_readme_first_command_runs_offline():
    proc = subprocess.run([sys.executable, "-m", "localctx.app.cli", "run", "--max-tokens", "24",
                           "Why is the sky blue? Answer in two sentences."],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 20
    stats = proc.stderr.strip().splitlines()[-1]
    assert "generated" in stats and "decode" in stats and "backend llamacpp" in stats and "policy fp16" in stats
