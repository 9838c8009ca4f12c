"""``localctx plan --calibrate`` for llama.cpp: time decode steps at several context lengths for each
KV format llama.cpp would use, interleaved round by round so that a busy machine slows every format
alike, and store the fitted per-format cost (kvcache.calibration) in the user cache directory.

One timed step = evaluate one token at position n, then drop it again (seq_rm), so every sample
of a context sees exactly n cached tokens. Medians of the samples are fitted.

It also times prompt lookup's verify steps (the pending token plus 1..MAX_DRAFT drafted ones, in
one batch with logits at every position, then rolled back) against the one-token step, at
VERIFY_CONTEXT cached tokens: the speculative loop's prior for what a draft costs here
(backends/generation/draft_policy.py)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from localctx.backends.machine.detect import detect
from localctx.backends.models.spec_reader import read_spec
from localctx.backends.models.ref import ModelRef, resolve
from localctx.kvcache import cost
from localctx.kvcache.calibration import Calibration, FormatCost, load_note, now_utc, save
from localctx.kvcache.policy import KVPolicy

# the settings timed per format; the faster fp16 variant wins (flash attention helps on some CPUs only)
# the step is flat for the first few hundred tokens and then grows linearly: time both stretches
CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
# (format, type_k, type_v, flash attention): keys and values apart too (quantized V needs flash attention)
VERIFY_CONTEXT = 512
VARIANTS = (("fp16", "f16", "f16", False), ("fp16", "f16", "f16", True), ("int8", "q8_0", "q8_0", True),
            ("int4", "q4_0", "q4_0", True), ("kf16v8", "f16", "q8_0", True), ("kf16v4", "f16", "q4_0", True),
            ("k8v4", "q8_0", "q4_0", True))


@dataclass
class _Probe:
    """One llama.cpp context holding ``n`` tokens, ready to time single decode steps at position n."""
    fmt: str
    type_name: str  # "q8_0", or "f16/q4_0" where keys and values differ
    flash_attn: bool
    n: int
    llm: object
    next_token: int
    samples: list

    def step(self) -> float:
        t0 = time.perf_counter()
        self.llm.eval([self.next_token])
        dt = time.perf_counter() - t0
        self.llm._ctx.kv_cache_seq_rm(-1, self.n, -1)  # drop it again: the next sample sees n tokens too
        self.llm.n_tokens = self.n
        return dt


def _text_tokens(llm, n: int) -> list[int]:
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics.values())
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)
    if len(ids) <= n:
        raise RuntimeError(f"the calibration text has only {len(ids)} tokens; need {n + 1}")
    return ids[: n + 1]


def _type_name(type_k: str, type_v: str) -> str:
    return type_k if type_k == type_v else f"{type_k}/{type_v}"


def _open(path: Path, type_k: str, type_v: str, flash_attn: bool, n_ctx: int, threads: int):
    import llama_cpp
    from llama_cpp import Llama

    from localctx.backends.llamacpp.session import quiet_stderr

    tid = lambda name: getattr(llama_cpp, f"GGML_TYPE_{name.upper()}")
    with quiet_stderr():
        return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_batch=512, type_k=tid(type_k),
                     type_v=tid(type_v),
                     flash_attn=flash_attn, verbose=False)


def calibrate(model: ModelRef | None = None, contexts: tuple[int, ...] = CONTEXTS, rounds: int = 5, steps: int = 4,
              threads: int | None = None, progress=print) -> Calibration:
    """Measure, fit and return a llama.cpp calibration for this machine (not yet saved).

    One context per variant is filled to each length in turn; at each length every variant is
    timed in the same rounds (interleaved), so load from other processes hits them alike."""
    from localctx.backends.llamacpp.session import default_threads

    ref = model or resolve(None)
    spec = read_spec(ref)
    hw = detect()
    threads = threads or default_threads()
    n_ctx = max(contexts) + 16
    llms = [_open(ref.path, type_k, type_v, fa, n_ctx, threads) for _, type_k, type_v, fa in VARIANTS]
    ids = _text_tokens(llms[0], max(contexts))
    probes: list[_Probe] = []
    prefill_rates = []
    verify: dict[int, float] = {}
    filled = 0
    for n in sorted(contexts):
        stage = []
        for (fmt, type_k, type_v, fa), llm in zip(VARIANTS, llms):
            t0 = time.perf_counter()
            llm.eval(ids[filled:n])
            if (fmt, fa) == ("fp16", False):
                prefill_rates.append((n - filled) / (time.perf_counter() - t0))
            stage.append(_Probe(fmt, _type_name(type_k, type_v), fa, n, llm, ids[n], []))
        progress(f"  filled {len(llms)} llama.cpp contexts to {n:,} tokens")
        for r in range(rounds):
            for probe in stage:
                probe.samples.extend(probe.step() for _ in range(steps))
        progress(f"  timed {rounds} interleaved rounds at {n:,} tokens")
        if n == VERIFY_CONTEXT or (VERIFY_CONTEXT not in contexts and not probes):
            verify = _verify_costs(llms[0], n_ctx, ids[n], rounds * steps)
            progress(f"  timed verify steps of 2..{max(verify)} tokens at {n:,} tokens")
        probes.extend(stage)
        filled = n
    for llm in llms:
        llm.close()
    cal = _fit(spec, ref, hw, probes, prefill_rates, threads)
    return replace(cal, note=cal.note + "; " + load_note(), verify_step_cost=verify)


def _verify_costs(llm, n_ctx: int, token: int, rounds: int) -> dict[int, float]:
    """T-token verify steps (T = 2..MAX_DRAFT + 1) in one-token steps: the fastest timing of each
    over the fastest one-token step through the same path, the lengths interleaved per round."""
    from localctx.backends.generation.speculation import MAX_DRAFT
    from localctx.backends.llamacpp.speculate import LlamaCppVerifier

    verifier = LlamaCppVerifier(llm, n_ctx, None)
    lengths = range(1, MAX_DRAFT + 2)
    times: dict[int, list[float]] = {t: [] for t in lengths}
    try:
        for _ in range(rounds):
            for t in lengths:
                t0 = time.perf_counter()
                verifier.step([token] * t)
                times[t].append(time.perf_counter() - t0)
                verifier.rollback(t)
    finally:
        verifier.close()
    plain = min(times[1])
    return {t: round(max(1.0, min(times[t]) / plain), 3) for t in lengths if t > 1}


def _fit(spec, ref, hw, probes: list[_Probe], prefill_rates: list[float], threads: int) -> Calibration:
    formats: dict[str, FormatCost] = {}
    lines = []
    for fmt, type_k, type_v, fa in VARIANTS:
        type_name = _type_name(type_k, type_v)
        mine = [p for p in probes if (p.fmt, p.type_name, p.flash_attn) == (fmt, type_name, fa)]
        policy = KVPolicy.parse(fmt)
        points = [(p.n, cost.kv_bytes(spec, policy, p.n), statistics.median(p.samples)) for p in mine]
        fc = FormatCost.fit(points, settings={"type": type_name, "flash_attn": fa})
        lines.append(f"{type_name} fa={'on' if fa else 'off'}: "
                     + ", ".join(f"{1 / s:.0f} tok/s at {n:,}" for n, _, s in points))
        longest = max(p[0] for p in points)
        if fmt not in formats or fc.step_s(cost.kv_bytes(spec, policy, longest)) < \
                formats[fmt].step_s(cost.kv_bytes(spec, policy, longest)):
            formats[fmt] = fc
    prefill = statistics.median(prefill_rates) if prefill_rates else 0.0
    flops = cost.prefill_flops(spec, 512) / 512 * prefill if prefill else 0.0
    return Calibration(backend="llamacpp", hardware_key=hw.key, model=spec.name, weight_bytes=spec.weight_bytes,
                       bandwidth_bytes_s=hw.bandwidth_bytes_s, formats=formats, prefill_tok_s=prefill,
                       prefill_flops_s=flops, threads=threads, measured_at=now_utc(),
                       note="; ".join(lines) + f" (llama.cpp flash attention choice per format: "
                       + ", ".join(f"{k}={'on' if v.settings['flash_attn'] else 'off'}" for k, v in formats.items())
                       + ")")


def calibrate_and_save(progress=print) -> tuple[Calibration, Path]:
    cal = calibrate(progress=progress)
    return cal, save(cal)
