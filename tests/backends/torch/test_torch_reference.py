"""The torch backend on the bundled SmolLM2 GGUF against llama.cpp (llama-cpp-python) on the same
file: the same token ids on hard strings, and next-token logits that agree (correlation ≥ 0.99,
the same top-5 set) for a chat prompt. llama.cpp computes with 4-bit weights and quantized
activations, so logits are compared with a tolerance, never text."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from localctx.backends.models.ref import resolve
from localctx.backends.torch.loading import TorchOptions, build_session, load_model
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy

pytestmark = pytest.mark.slow

HARD_STRINGS = [
    "12345678 and 3.14159, 1,000,000 or 007",
    "a  b   c    d\t\te\n\n\nf \n g   ",
    "def f(x):\n    return x**2  # square\n\tpass\n}",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "中文字符和日本語のテキスト 한국어",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "I'm, you're, they've, he'll, she'd, it's, DON'T, We'Re",
    "ÀÉÎõü café naïve",
    "<|endoftext|>text<|im_end|>",
    "Hello world\r\nWindows",
]


@pytest.fixture(scope="module")
def smollm():
    ref = resolve(None)
    options = TorchOptions(device="cpu", dtype=torch.float32)
    loaded = load_model(ref, options)
    return ref, build_session(loaded, Plan.fixed("torch", loaded.spec, KVPolicy(), 512), options)


def test_token_ids_match_llama_cpp_on_hard_strings(smollm):
    from llama_cpp import Llama

    ref, session = smollm
    vocab = Llama(str(ref.path), vocab_only=True, verbose=False)
    for text in HARD_STRINGS:
        assert session.tokenizer.encode(text) == vocab.tokenize(text.encode(), add_bos=False, special=True), text
        plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "").replace("<|endoftext|>", "")
        if plain == text:
            assert session.tokenizer.decode(session.tokenizer.encode(text)) == text


def test_next_token_logits_match_llama_cpp(smollm):
    from llama_cpp import Llama

    ref, session = smollm
    messages = [{"role": "user", "content": "Give me three tips for writing clear Python code."}]
    text = session.render(messages)
    ids = session.tokenizer.encode(text)
    session.engine.cache.add_sequence(7)
    try:
        ours = session.engine.prefill(7, ids).numpy()
    finally:
        session.engine.cache.finish(7)
    llm = Llama(str(ref.path), n_ctx=256, logits_all=True, n_threads=2, verbose=False)
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    llm.eval(ids)
    theirs = np.asarray(llm.scores[len(ids) - 1])
    assert np.corrcoef(ours, theirs)[0, 1] >= 0.99
    assert set(np.argsort(-ours)[:5]) == set(np.argsort(-theirs)[:5])
