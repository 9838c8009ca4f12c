"""Whether flash attention keeps a reused prefix exact, for this model on this CPU and llama.cpp build:
probed once, remembered.

Two promises of a full-precision (fp16) session rest on llama.cpp giving the same bits either way:
- a prompt that reuses cached cells (a chat's earlier turns, the prompt cache on disk, an edited
  message's prefix) answers as a cold run of the same prompt does;
- prompt lookup's verify batches give one-token decoding's logits (speculate.exact_rows), so
  ``--speculate ngram`` answers with ``--speculate off``'s text.
Which kernels keep them depends on the CPU and the build. Without flash attention the first held
everywhere tried (with two rows or more evaluated again: session.REPLAY) and the second nowhere. With
it, the llama.cpp in use computes a batch of 64 rows or more with a tiled kernel that sums in another
order than the per-row kernel of a shorter batch, so a prompt of 64 tokens or more reused with a short
rest differs from its cold run (by up to 1.0 in a logit, SmolLM2 on AVX2); a probe of 40 tokens, under
the tile, had found it exact. And past 256 tokens in a context of 512 cells or more a one-token step
splits the cache across threads (speculate.exact_rows). So an fp16 session takes flash attention only
where this probe finds reuse exact with it (shift.flash_attn_for), and a session that drafts takes the
same setting as one that does not.

The probe, in a small context of its own on the session's weights with flash attention on and the
session's other context settings: a fixed text of ``TEXT_TOKENS`` prefilled in one batch (as a long
prompt is), then a few greedy one-token steps (the cold run); the text prefilled in one batch again, its
cells cut back to each of ``CUTS``, the rest prefilled as a second batch (a new turn's few dozen tokens;
the REPLAY rows of a prompt asked again), then the same steps (the reuse). Exact: the logits after the
prefill and after each step are equal bit for bit. The verdict is kept in the user cache, keyed by this
CPU's feature flags and the llama.cpp build (guard.probe_key), the model file's identity, the KV types,
the sliding-window cache layout and the threads; written atomically, and a damaged or foreign file is
probed again."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from localctx.backends.llamacpp.speculate import ProbeContext, probe_tokens
from localctx.kvcache.calibration import verify_costs
from localctx.kvcache.hardware_profile import cache_dir
from localctx.kvcache.private_files import read_trusted, write_private

VERSION = 2  # 1: a 40-token text, under the tiled kernel's 64 rows
TEXT_TOKENS = 96  # the probe text's tokens, prefilled in one batch (past the tiled kernel's 64 rows)
CUTS = (72, 94)  # the prefixes a reuse keeps: 24 tokens prefilled again as a second batch; 2 (REPLAY)
STEPS = 3  # greedy one-token steps after each prefill
CELLS = 256  # the probe's own context: under 512 cells, where a one-token step keeps one thread's sums


def cache_key(model_file: Path, type_k: int, type_v: int, swa_full: bool, threads: int,
              flash_attn: bool | None = None) -> str:
    """What a verdict holds for: the build and CPU, the model file, and the context settings a session
    opens with (known before it opens, so a remembered verdict decides its flash attention at once);
    ``flash_attn`` for a verdict measured under the session's setting (speculate.exact_rows)."""
    from localctx.backends.llamacpp.guard import library_dir, probe_key
    from localctx.kvcache.quality_calibration import identity

    lib = library_dir()
    text = json.dumps({"probe": VERSION, "build_cpu": probe_key(lib) if lib else "", "model": identity(model_file),
                       "type_k": type_k, "type_v": type_v, "swa_full": swa_full, "threads": threads,
                       "flash_attn": flash_attn},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# what is remembered, and its type: this probe's verdict; the verify rows of speculate.exact_rows and what
# its verify steps cost (speculate.ProbeTimes.costs: rows, as a string, → one-token steps)
KINDS = {"reuse-exact": bool, "verify-rows": int, "verify-cost": dict}


def verdict_path(key: str, kind: str = "reuse-exact") -> Path:
    return cache_dir() / "llamacpp" / f"{kind}-{key}.json"


def cached(key: str, kind: str = "reuse-exact") -> bool | int | dict | None:
    """The remembered verdict, or None when there is none this build, CPU and model may use."""
    text = read_trusted(verdict_path(key, kind))
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("key") != key or type(doc.get("value")) is not KINDS[kind]:
        return None
    if kind == "verify-cost":
        try:
            verify_costs(doc["value"])
        except (TypeError, ValueError):
            return None
    return doc["value"]


def remember(key: str, value: bool | int | dict, kind: str = "reuse-exact") -> None:
    write_private(verdict_path(key, kind), json.dumps({"version": VERSION, "key": key, "value": value}))


def reuse_logits(probe: ProbeContext, tokens: list[int], cut: int | None, steps: int = STEPS) -> list[np.ndarray]:
    """Logits after ``tokens`` prefilled in one batch and after each of ``steps`` greedy one-token
    steps; with ``cut``, the prefill is redone from that many cached tokens (the text prefilled whole
    first, then cut back, as a turn leaves its cells). The probe starts and ends empty."""
    probe.rollback(probe.n)
    last = probe.step(tokens, every_row=False)[0]
    if cut is not None:
        probe.rollback(len(tokens) - cut)
        last = probe.step(tokens[cut:], every_row=False)[0]
    out = [last]
    for _ in range(steps):
        out.append(probe.step([int(np.argmax(out[-1]))])[0])
    probe.rollback(probe.n)
    return out


def reuse_exact_with_flash_attention(llm) -> bool:
    """Measured now (three prefills of 96 tokens, two short ones and nine one-token steps on ``llm``'s
    weights; the second cut only where the first holds)."""
    probe = ProbeContext(llm, TEXT_TOKENS, CELLS, flash_attn=True)
    try:
        tokens = probe_tokens(llm, TEXT_TOKENS)
        cold = reuse_logits(probe, tokens, None)
        return all(all(np.array_equal(a, b) for a, b in zip(cold, reuse_logits(probe, tokens, cut)))
                   for cut in CUTS)
    finally:
        probe.close()
