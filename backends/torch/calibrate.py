"""``localctx plan --calibrate --backend torch``: time the torch backend's decode steps at three
context lengths for each KV format (and for fp16 in the windowed policies' cache), with the
settings it runs with now (device, dtype, weight format, threads), and store the fitted
per-format cost (kvcache.calibration) in the user cache.

The torch backend's speed depends on those settings far more than on the bandwidth roofline: on a
CPU, bf16 activations with int8 weights read 129 MiB per step where the GGUF's Q4_1 is 92 MiB,
and the policy cache's attention (quantized or windowed KV) runs in the C kernel
(``cpu_kernels/``) where it builds, or in the pure-torch reference, several times slower, where
it does not. So a calibration is stored per setting (``TorchOptions.speed_key``) and used only
when the backend runs with those settings.

Every format's cache is filled to each length in turn; at each length the formats are timed in
interleaved rounds, so load from other processes hits them alike. A sample is one engine decode
step plus the greedy argmax, as generation does it."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from localctx.backends.machine.detect import detect
from localctx.backends.models.spec_reader import read_spec
from localctx.backends.models.ref import ModelRef, resolve
from localctx.backends.torch.backend import TorchBackend
from localctx.backends.torch.loading import build_session, load_model
from localctx.kvcache import cost
from localctx.kvcache.calibration import Calibration, FormatCost, load_note, now_utc, save
from localctx.kvcache.plan import Plan
from localctx.kvcache.planner import RESIDUAL
from localctx.kvcache.policy import KVPolicy, uniform

CONTEXTS = (256, 2048, 8192)
ROUNDS, STEPS = 4, 4


def _room(contexts: tuple[int, ...], rounds: int, steps: int) -> int:
    """Tokens the longest cache reaches: filled to the longest context, then every timed step."""
    return max(contexts) + rounds * steps * len(contexts) + 1


ROOM = _room(CONTEXTS, ROUNDS, STEPS)
# the policy timed for each format: what the planner proposes for it. A windowed fp16 policy runs in
# the policy cache (keys kept before RoPE, rotated at every step), not the paged one: it is timed
# with a window wider than anything it holds here, so it never evicts and holds what the others hold.
# Keys and values apart (k8v4, kf16v8, kf16v4) are timed too: their attention mixes a full-precision
# or 8-bit key path with a 4- or 8-bit value path, so their cost is not any uniform format's.
POLICIES = {"fp16": KVPolicy(), "int8": uniform(8), "int4": uniform(4, residual=RESIDUAL),
            "k8v4": KVPolicy(k_bits=8, v_bits=4), "kf16v8": KVPolicy(k_bits=16, v_bits=8),
            "kf16v4": KVPolicy(k_bits=16, v_bits=4), "fp16-windowed": KVPolicy(sinks=4, window=ROOM)}
SEQ = 0


@dataclass
class _Probe:
    """One format's session: its cache grows through the contexts; samples are kept per context."""
    fmt: str
    session: object
    length: int = 0
    token: int = 0
    samples: dict = field(default_factory=dict)  # context → [(cache length, seconds)]

    def fill(self, ids: list[int], n: int) -> float:
        """Prefill up to ``n`` tokens (decoded tokens count too); returns the prefill seconds."""
        engine = self.session.engine
        if not engine.cache.has(SEQ):
            engine.cache.add_sequence(SEQ)
        t0 = time.perf_counter()
        logits = engine.prefill(SEQ, ids[self.length:n])
        dt = time.perf_counter() - t0
        self.token, self.length = int(logits.argmax(-1)), n
        return dt

    def step(self, context: int) -> None:
        engine = self.session.engine
        t0 = time.perf_counter()
        logits = engine.decode([SEQ], [self.token])
        self.token = int(logits[0].argmax(-1))
        dt = time.perf_counter() - t0
        self.samples.setdefault(context, []).append((self.length, dt))
        self.length += 1


def _text_ids(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    if len(ids) < n:
        raise RuntimeError(f"the calibration text has only {len(ids)} tokens; need {n}")
    return ids[:n]


def calibrate(model: ModelRef | None = None, contexts: tuple[int, ...] = CONTEXTS, rounds: int = ROUNDS,
              steps: int = STEPS, progress=print) -> Calibration:
    """Measure, fit and return a torch calibration for this machine and these settings (not yet saved)."""
    backend = TorchBackend()
    options = backend.options()
    ref = model or resolve(None)
    spec = read_spec(ref)  # the planner's view of the model (its file's weight bytes), as projections use
    hw = detect()
    loaded = load_model(ref, options)
    room = _room(contexts, rounds, steps)
    if room > ROOM:
        raise ValueError(f"contexts and steps need {room:,} tokens; the windowed probe holds {ROOM:,}")
    ids = _text_ids(loaded.tokenizer, max(contexts))
    probes = [_Probe(fmt, build_session(loaded, Plan.fixed("torch", spec, policy, room), options))
              for fmt, policy in POLICIES.items()]
    prefill_rates = []
    with torch.inference_mode():
        for n in sorted(contexts):
            for probe in probes:
                if probe.length >= n:  # the steps timed at the previous length already reached n
                    continue
                before = probe.length
                seconds = probe.fill(ids, n)
                if probe.fmt == "fp16":
                    prefill_rates.append((n - before) / seconds)
            progress(f"  filled {len(probes)} torch caches to {n:,} tokens")
            for _ in range(rounds):
                for probe in probes:
                    for _ in range(steps):
                        probe.step(n)
            progress(f"  timed {rounds} interleaved rounds at {n:,} tokens")
    for probe in probes:
        probe.session.close()
    return _fit(spec, hw, probes, prefill_rates, backend.calibration_name(), options.speed_settings())


def _fit(spec, hw, probes: list[_Probe], prefill_rates: list[float], name: str, settings: dict) -> Calibration:
    formats, lines = {}, []
    for probe in probes:
        policy = POLICIES[probe.fmt]
        points = []
        for samples in probe.samples.values():
            length = statistics.median(s[0] for s in samples)
            points.append((int(length), cost.kv_bytes(spec, policy, int(length)), statistics.median(s[1] for s in samples)))
        formats[probe.fmt] = FormatCost.fit(points, settings={"policy": str(policy), **settings})
        lines.append(f"{probe.fmt} ({policy}): " + ", ".join(f"{1 / s:.1f} tok/s at {n:,}" for n, _, s in points))
    prefill = statistics.median(prefill_rates) if prefill_rates else 0.0
    flops = cost.prefill_flops(spec, 512) / 512 * prefill if prefill else 0.0
    described = ", ".join(f"{k}={v}" for k, v in settings.items())
    return Calibration(backend=name, hardware_key=hw.key, model=spec.name, weight_bytes=spec.weight_bytes,
                       bandwidth_bytes_s=hw.bandwidth_bytes_s, formats=formats, prefill_tok_s=prefill,
                       prefill_flops_s=flops, threads=int(settings.get("threads", 0)), measured_at=now_utc(),
                       note=f"torch {described}: " + "; ".join(lines)
                       + "; " + load_note())


def calibrate_and_save(progress=print) -> tuple[Calibration, Path]:
    cal = calibrate(progress=progress)
    return cal, save(cal)
