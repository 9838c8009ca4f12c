"""Whether flash attention keeps a reused prefix exact, for this model on this CPU and llama.cpp build:
probed once, remembered.

Two promises of a full-precision (fp16) session rest on llama.cpp giving the same bits either way:
- a prompt that reuses cached cells (a chat's earlier turns, the prompt cache on disk, an edited
  message's prefix) answers as a cold run of the same prompt does;
- prompt lookup's verify batches give one-token decoding's logits (speculate.exact_rows), so
  ``--speculate ngram`` answers with ``--speculate off``'s text.
Which kernels keep them depends on the CPU: with flash attention the second held on every host tried
and the first held on AVX2 hosts but not on an AVX-512 one; without it the first held everywhere and
the second nowhere. So an fp16 session takes flash attention only where this probe finds reuse exact
with it (shift.flash_attn_for), and a session that drafts takes the same setting as one that does not.

The probe, in a small context of its own on the session's weights with flash attention on and the
session's other context settings: a fixed text prefilled in one batch, then a few greedy one-token
steps (the cold run); the text prefilled in one batch again, its cells cut back to a prefix, the rest
prefilled as a second batch, then the same steps (the reuse). Exact: the logits after the prefill and
after each step are equal bit for bit. The verdict is kept in the user cache, keyed by this CPU's
feature flags and the llama.cpp build (guard.probe_key), the model file's identity, the KV types, the
sliding-window cache layout and the threads; written atomically, and a damaged or foreign file is
probed again."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from localctx.backends.llamacpp.speculate import ProbeContext, probe_tokens
from localctx.kvcache.hardware_profile import cache_dir
from localctx.kvcache.private_files import read_trusted, write_private

VERSION = 1
TEXT_TOKENS = 40  # the probe text's tokens, prefilled in one batch
REUSED = 16  # the prefix the reuse keeps; the other 24 tokens are prefilled again as a second batch
STEPS = 3  # greedy one-token steps after each prefill


def cache_key(model_file: Path, type_k: int, type_v: int, swa_full: bool, threads: int) -> str:
    """What a verdict holds for: the build and CPU, the model file, and the context settings a session
    opens with (known before it opens, so a remembered verdict decides its flash attention at once)."""
    from localctx.backends.llamacpp.guard import library_dir, probe_key
    from localctx.kvcache.quality_calibration import identity

    lib = library_dir()
    text = json.dumps({"probe": VERSION, "build_cpu": probe_key(lib) if lib else "", "model": identity(model_file),
                       "type_k": type_k, "type_v": type_v, "swa_full": swa_full, "threads": threads},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def verdict_path(key: str) -> Path:
    return cache_dir() / "llamacpp" / f"reuse-exact-{key}.json"


def cached(key: str) -> bool | None:
    """The remembered verdict, or None when there is none this build, CPU and model may use."""
    text = read_trusted(verdict_path(key))
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("key") != key or not isinstance(doc.get("exact"), bool):
        return None
    return doc["exact"]


def remember(key: str, exact: bool) -> None:
    write_private(verdict_path(key), json.dumps({"version": VERSION, "key": key, "exact": exact}))


def _run(probe: ProbeContext, tokens: list[int], cut: int | None) -> list[np.ndarray]:
    """Logits after the prefill and after each greedy step; with ``cut``, the prefill is redone from
    that many cached tokens (the text prefilled whole first, then cut back, as a turn leaves its cells)."""
    last = probe.step(tokens, every_row=False)[0]
    if cut is not None:
        probe.rollback(len(tokens) - cut)
        last = probe.step(tokens[cut:], every_row=False)[0]
    out = [last]
    for _ in range(STEPS):
        out.append(probe.step([int(np.argmax(out[-1]))])[0])
    probe.rollback(probe.n)
    return out


def reuse_exact_with_flash_attention(llm) -> bool:
    """Measured now (about three prefills of 40 tokens and six one-token steps on ``llm``'s weights)."""
    probe = ProbeContext(llm, TEXT_TOKENS, flash_attn=True)
    try:
        tokens = probe_tokens(llm, TEXT_TOKENS)
        cold = _run(probe, tokens, None)
        reused = _run(probe, tokens, REUSED)
        return all(np.array_equal(a, b) for a, b in zip(cold, reused))
    finally:
        probe.close()
