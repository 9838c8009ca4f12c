"""Structured output on the engines that sample in Python (torch, MLX): an ``OutputConstraint`` as an
llguidance grammar, and per answer a ``Guide`` that says which tokens may come next (a boolean mask
over the logits) and follows the tokens sampled.

llguidance (docs/serve.md says why it, not xgrammar): a Rust library with no Python dependencies;
its masks are plain bitmasks, applied here with numpy, so neither torch nor MLX is needed by it. Each
shape of the constraint becomes a Lark rule: its prefix, the JSON Schema inlined with ``%json``, its
suffix. JSON is written with ", " and ": " between items and no other whitespace (a model cannot run
away in whitespace); a schema's own ``x-guidance`` options take precedence."""
from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from localctx.backends.base import OutputConstraint

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL = "pip install llguidance (it comes with localctx's torch and mlx extras)"


@dataclass(frozen=True)
class Vocabulary:
    """What llguidance needs of a tokenizer: each token's bytes (a special token: b"\\xff" and its
    text, so that no text can produce it), the end-of-text tokens, and text → token ids."""
    pieces: tuple[bytes, ...]
    eos: tuple[int, ...]
    encode: Callable[[str], list[int]]


def vocabulary(n_vocab: int, token_bytes: Callable[[int], bytes], special: dict[int, str], eos,
               encode: Callable[[str], list[int]]) -> Vocabulary:
    """A Vocabulary from a tokenizer's parts: ``special`` maps each control token to its text."""
    pieces = tuple(b"\xff" + special[i].encode() if i in special else token_bytes(i) for i in range(n_vocab))
    return Vocabulary(pieces, tuple(sorted(eos)), encode)


def lark(constraint: OutputConstraint) -> str:
    """The Lark grammar of ``constraint``: one alternative per shape."""
    lines, names = [], []
    for i, shape in enumerate(constraint.shapes):
        schema = json.loads(shape.schema)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}}
        parts = ([json.dumps(shape.prefix)] if shape.prefix else []) + [f"json{i}"] + \
                ([json.dumps(shape.suffix)] if shape.suffix else [])
        lines += [f"shape{i}: {' '.join(parts)}", f"json{i}: %json {json.dumps(schema)}"]
        names.append(f"shape{i}")
    return "\n".join([f"start: {' | '.join(names)}"] + lines) + "\n"


class _Wrapper:
    """The tokenizer object llguidance's TokenizerWrapper reads."""

    def __init__(self, vocabulary: Vocabulary):
        self.eos_token_id = vocabulary.eos[0]
        self.bos_token_id = None
        self.tokens = list(vocabulary.pieces)
        self.special_token_ids = [i for i, p in enumerate(vocabulary.pieces) if p.startswith(b"\xff")]
        self._encode = vocabulary.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


class Guides:
    """llguidance's tokenizer for one vocabulary (built on first use: about half a second for 50K
    tokens) and the grammars compiled for it."""

    def __init__(self, vocabulary: Callable[[], Vocabulary]):
        self._vocabulary = vocabulary
        self._lock = threading.Lock()
        self._tokenizer = None
        self.n_vocab = 0

    def _llg_tokenizer(self):
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                vocab = self._vocabulary()
                self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapper(vocab)),
                                                         eos_token=list(vocab.eos))
                self.n_vocab = len(vocab.pieces)
            return self._tokenizer

    @functools.lru_cache(maxsize=64)
    def _grammar(self, constraint: OutputConstraint) -> tuple[str, str | None]:
        """(grammar, error): llguidance's grammar and its complaint, if any, for this tokenizer."""
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(lark(constraint))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._llg_tokenizer())
        if not is_error:
            return grammar, None
        # its first line, without the place in the Lark text made here (the rest quotes that text)
        first = (messages[0] if messages else "unknown error").splitlines()[0]
        return grammar, re.sub(r"^at \d+\(\d+\): ", "", first)

    def refusal(self, constraint: OutputConstraint) -> str | None:
        """Why llguidance cannot sample under ``constraint`` (installed, and the schema compiles), or None."""
        try:
            _, error = self._grammar(constraint)
        except ImportError:
            return f"{constraint.field}: structured output on this backend needs llguidance; {INSTALL}"
        if error:
            return f"{constraint.field}: llguidance cannot compile the schema: {error}"
        return None

    def guide(self, constraint: OutputConstraint) -> "Guide":
        import llguidance

        grammar, error = self._grammar(constraint)
        if error:
            from localctx.kvcache.errors import UserError

            raise UserError(f"{constraint.field}: llguidance cannot compile the schema: {error}")
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        return Guide(matcher, self.n_vocab)


class Guide:
    """One answer's place in its grammar: ``allowed`` before each sample, ``accept`` after it."""

    def __init__(self, matcher, n_vocab: int):
        self.matcher = matcher
        self.n_vocab = n_vocab

    def allowed(self, n_logits: int) -> np.ndarray:
        """A boolean mask over ``n_logits`` logits: True where the token may come next (once the
        grammar is complete, only the end-of-text tokens). Logits past the vocabulary are never allowed."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:min(self.n_vocab, n_logits)].astype(bool)
        if n_logits > mask.size:
            mask = np.concatenate([mask, np.zeros(n_logits - mask.size, dtype=bool)])
        return mask

    def accept(self, token: int) -> None:
        """Follows the sampled token (an end-of-text token after the grammar's end is a no-op)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(int(token))

    @property
    def error(self) -> str:
        return self.matcher.get_error()
