"""A fake backend with deterministic output: what the surfaces' tests run against.

Tokens are words (with their trailing whitespace). The reply starts with the first words of the
last user message, so tests can see which prompt produced it; with temperature > 0 and a seed the
rest varies with the seed. ``delay`` (seconds per token; env LOCALCTX_FAKE_DELAY) makes streaming
slow enough to stop mid-answer."""
from __future__ import annotations

import os
import random
import re
import threading
import time
from typing import Iterator

from localctx.backends.base import (GenerationEvent, GenerationParams, Prompt, Session,
                                    StatsClock, check_prompt_fits)
from localctx.backends.generation.decode_loop import KVProbe, stream
from localctx.kvcache import cost
from localctx.kvcache.plan import Plan
from localctx.kvcache.model_spec import ModelSpec

FAKE_SPEC = ModelSpec(name="fake", architecture="llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      hidden_size=64, vocab_size=1000, context_length=4096, weight_bytes=1_000_000,
                      n_params=500_000)
_WORDS = ("the cache keeps recent tokens while sinks hold the start and quantized keys save memory "
          "so long contexts fit in the budget of a small machine").split()
_TOKEN = re.compile(r"\s*\S+\s*|\s+")
EOS = -1


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def render(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "".join(f"<{m['role']}> {m['content']}\n" for m in prompt) + "<assistant> "


class FakeSession(Session):
    def __init__(self, plan: Plan, delay: float):
        self.spec = FAKE_SPEC
        self.plan = plan
        self.backend_name = "fake"
        self.decode_threads = 1  # its generator sleeps between tokens on one thread
        self.delay = delay
        self.history: list[str] = []  # tokens in the cache's stream, oldest first
        self.vocab: list[str] = []

    def count_tokens(self, prompt: Prompt) -> int:
        return len(tokenize(render(prompt)))

    def reset(self) -> None:
        self.history = []

    def _kv(self) -> tuple[int, int, int]:
        n = len(self.history)
        kept = self.plan.policy.kept_tokens(n)
        return cost.kv_bytes(self.spec, self.plan.policy, n), kept, n - kept

    def _reply(self, prompt: Prompt, params: GenerationParams) -> tuple[list[str], int]:
        """(the reply's words, enough for max_tokens; where EOS comes, unless max_tokens comes first
        or ignore_eos goes past it)."""
        last_user = prompt if isinstance(prompt, str) else next(
            (m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
        head = [w + " " for w in last_user.split()[:8]]
        seed = params.seed if params.temperature > 0 and params.seed is not None else len(last_user)
        rng = random.Random(seed)
        tail = [rng.choice(_WORDS) + " " for _ in range(max(0, params.max_tokens - len(head) - 1))]
        return ["Reply: "] + head + tail, 12 + len(last_user) % 20

    def generate(self, prompt: Prompt, params: GenerationParams = GenerationParams(),
                 cancel: threading.Event | None = None) -> Iterator[GenerationEvent]:
        tokens = tokenize(render(prompt))
        check_prompt_fits(len(tokens), self.plan, self.spec, params.max_tokens)
        common = 0
        for a, b in zip(self.history, tokens):
            if a != b:
                break
            common += 1
        self.history = list(tokens)
        clock = StatsClock(backend="fake", policy=str(self.plan.policy), prompt_tokens=len(tokens),
                           cached_tokens=common)
        reply, n_answer = self._reply(prompt, params)
        self.vocab = reply

        def ids() -> Iterator[int]:
            for i in range(len(reply) + 1):  # EOS after n_answer words; with ignore_eos the words go on
                if self.delay:
                    time.sleep(self.delay)
                if i == n_answer:
                    yield EOS
                yield i if i < len(reply) else EOS

        def accept(i: int) -> None:
            self.history.append("</s>" if i == EOS else reply[i])

        yield from stream(ids(), token_bytes=lambda i: reply[i].encode(), eos={EOS}, params=params,
                          clock=clock, probe=KVProbe(self._kv), cancel=cancel, on_accept=accept)

