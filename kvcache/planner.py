"""The planner (docs/architecture.md "Planner"): picks the KV policy from memory capacity, bandwidth and the
backend's calibrated costs, and explains the choice and every rejected alternative.

Order of preference: exact fp16 → int8 → k8v4 (keys keep 8 bits where int8 does not fit) → int4
(+ a full-precision residual where the backend has one) → lossy sinks + the largest window that
fits (optionally heavy hitters). kf16v8 (before int8) and kf16v4 (after it) are considered only
where the backend's calibration measured them: they hold more bytes than int8, so they win only
by measured speed or where int8 is refused. The first candidate the backend can run, whose
measured quality on that backend meets the goals (kvcache/quality.py), that fits the KV budget
(free memory − weights − runtime − safety margin), holds the requested context within the
trained length, and meets the speed target, wins."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable

from localctx.kvcache import cost
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.errors import UserError
from localctx.kvcache.eviction import policy_cache_layout
from localctx.kvcache.hardware_profile import HardwareProfile, MiB
from localctx.kvcache.plan import Plan, Rejected
from localctx.kvcache.policy import KVPolicy, uniform
from localctx.kvcache.kld_quality import DEFAULT_MAX_KLD, NO_FIGURES, KldTable, window_key
from localctx.kvcache.quality import NO_VERDICTS, BackendQuality, QualityTable
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.speed import SpeedModel

SINKS = 4  # StreamingLLM: four initial tokens carry the attention sink
RESIDUAL = 128  # recent tokens kept in full precision by a quantized cache (KIVI)
MIN_WINDOW = 128  # a window smaller than this is not a useful plan
SPEED_MARGIN = 1.10  # plan for 10% above a --min-tok-s target: measured speed scatters around the projection
HEAVY_FRACTION = 4  # with heavy hitters on, 1/4 of the kept tokens are heavy hitters
SAFETY_FRACTION = 0.05  # of free memory, at least SAFETY_MIN
SAFETY_MIN = 256 * MiB
BATCH = 512  # tokens per prefill batch: sizes the runtime's activation buffers


def cache_cap(spec: ModelSpec) -> int:
    """Most tokens a lossy plan keeps unasked (sinks + window): half the trained context. Past a few
    thousand tokens StreamingLLM's perplexity stays flat while every cached token costs decode time."""
    return spec.context_length // 2


@dataclass(frozen=True)
class PlanRequest:
    context: int | None = None  # tokens to hold (prompt + answer); None = the model's trained context
    min_tok_s: float | None = None  # decode speed target at the slowest point of the stream
    exact: bool = False  # only exact plans (full precision, nothing evicted)
    max_memory: int | None = None  # cap on weights + KV + runtime, in bytes
    heavy: bool = False  # also consider heavy-hitter (H2O) candidates
    max_kld: float = DEFAULT_MAX_KLD  # quality budget: mean KL divergence per token, nats (kvcache/kld_quality.py)


@dataclass(frozen=True)
class BackendView:
    """What the planner needs from a backend, without importing one (kvcache must not). ``allocated``
    is the backend's own KV allocation for (spec, policy, context) where it differs from the cost
    model's peak (llama.cpp pads cells and sizes sliding layers its own way); None: the cost model's.
    ``describe`` says what the backend's cache holds for a policy (``Backend.describe_kv``)."""
    name: str
    refusals: Callable[[KVPolicy], list[str]]
    allocated: Callable[[ModelSpec, KVPolicy, int], int] | None = None
    describe: Callable[[KVPolicy], str] = policy_cache_layout
    quality_table: QualityTable = NO_VERDICTS  # measured quality per backend (assets/kv_quality.json)
    kld: KldTable = NO_FIGURES  # this model's KL divergence per format: its calibration, else priors
    # bytes of a full-precision KV element as the backend holds it on the planned hardware, where that is not
    # the model file's (Backend.kv_elem_bytes: torch and MLX hold the dtype they compute in, float32 on a CPU)
    elem_bytes: int | None = None

    @property
    def quality(self) -> BackendQuality:
        return self.quality_table.for_backend(self.name)

    def kv_bytes(self, spec: ModelSpec, policy: KVPolicy, context: int) -> int:
        """Peak KV bytes of ``policy`` over ``context`` tokens, as this backend holds them."""
        if self.elem_bytes is not None:
            spec = replace(spec, kv_elem_bytes=self.elem_bytes)
        if self.allocated is not None:
            return self.allocated(spec, policy, context)
        return cost.max_kv_bytes(spec, policy, context)


class NoPlanFits(UserError):
    """No candidate fits. ``headline`` says what and how to fix it; the message adds each
    candidate's reason on the same line (surfaces print errors as one line); ``rejected`` lists them."""

    def __init__(self, headline: str, rejected: list[Rejected]):
        detail = "; ".join(f"{r.policy}: {r.reason}" for r in rejected)
        super().__init__(headline + (f" ({detail})" if detail else ""))
        self.headline = headline
        self.rejected = rejected


@dataclass(frozen=True)
class Budget:
    free: int
    weights: int
    runtime: int
    margin: int
    limited_by: str  # "free memory" or "--max-memory"

    @property
    def kv(self) -> int:
        return self.free - self.weights - self.runtime - self.margin

    def describe(self) -> str:
        return (f"KV budget {format_bytes(max(self.kv, 0))} = {self.limited_by} {format_bytes(self.free)} − weights "
                f"{format_bytes(self.weights)} − runtime {format_bytes(self.runtime)} − safety margin "
                f"{format_bytes(self.margin)}")


def default_runtime_bytes(spec: ModelSpec, kind: str) -> int:
    """Buffers beyond weights and KV: the engine's own (a CUDA context is ~0.5 GiB) plus the
    activations and logits of one prefill batch in fp32."""
    base = 512 * MiB if kind == "cuda" else 128 * MiB
    activations = BATCH * (4 * spec.hidden_size + 2 * (spec.intermediate_size or 4 * spec.hidden_size)) * 4
    logits = BATCH * spec.vocab_size * 4
    return base + activations + logits


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'6GB' → 6e9 bytes, '800MiB' → 800·2²⁰, '1.5gib', '123456' (bytes)."""
    m = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$", text or "")
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"memory size {text!r} is not understood; write it like 6GB, 6GiB or 800MiB")
    return int(float(m.group(1)) * _UNITS[unit])


def budget(hw: HardwareProfile, spec: ModelSpec, req: PlanRequest, backend: BackendView) -> Budget:
    free, limited_by = hw.free_bytes, "free memory"
    if req.max_memory is not None and req.max_memory < free:
        free, limited_by = req.max_memory, "--max-memory"
    runtime = default_runtime_bytes(spec, hw.kind)
    margin = max(SAFETY_MIN, int(free * SAFETY_FRACTION))
    return Budget(free=free, weights=spec.weight_bytes, runtime=runtime, margin=margin, limited_by=limited_by)


# keys and values apart, with full-precision keys: more bytes than int8, so chosen only where measured
MEASURED_ONLY = (KVPolicy(k_bits=16, v_bits=8), KVPolicy(k_bits=16, v_bits=4))


def exact_candidates(speed: SpeedModel | None = None) -> list[KVPolicy]:
    """In order of fidelity: fp16, [kf16v8], int8, [kf16v4], k8v4, int4+res, int4; the bracketed
    ones only where ``speed``'s calibration measured them."""
    measured = [p for p in MEASURED_ONLY if speed is not None and speed.calibrated(p)]
    kf16v8, kf16v4 = ([p] if p in measured else [] for p in MEASURED_ONLY)
    return [KVPolicy(), *kf16v8, uniform(8), *kf16v4, KVPolicy(k_bits=8, v_bits=4),
            uniform(4, residual=RESIDUAL), uniform(4)]


def lossy_templates(heavy: bool) -> list[KVPolicy]:
    """Windowed shapes in order of fidelity; the window is sized per candidate (placeholder 1024 here).
    Full-precision keys with quantized values (kf16v8, kf16v4) widen the window where an engine
    cannot shift quantized keys (llama.cpp); elsewhere int8 / int4 windows are wider."""
    out = [KVPolicy(k_bits=k, v_bits=v, residual=r, sinks=SINKS, window=1024)
           for k, v, r in ((16, 16, 0), (16, 8, 0), (8, 8, 0), (16, 4, 0), (8, 4, 0), (4, 4, RESIDUAL), (4, 4, 0))]
    if heavy:
        out += [replace(p, heavy=256) for p in out]
    return out


def _shape(template: KVPolicy) -> str:
    """A windowed template's text form with its window still open: 'int8+sink4+winN'."""
    return str(replace(template, window=1)).replace("win1", "winN")


@dataclass
class _Search:
    hw: HardwareProfile
    spec: ModelSpec
    req: PlanRequest
    backend: BackendView
    speed: SpeedModel
    context: int
    budget: Budget
    rejected: list[Rejected] = field(default_factory=list)
    over_budget: list[str] = field(default_factory=list)  # formats refused by the KL divergence budget

    def reject(self, policy: KVPolicy | str, reason: str, template: KVPolicy | None = None) -> None:
        fig = self.backend.kld.figure(template or policy) if isinstance(template or policy, KVPolicy) else None
        self.rejected.append(Rejected(self.backend.name, str(policy), reason, fig.to_dict() if fig else None))

    def quality_refusal(self, policy: KVPolicy) -> str | None:
        """Over the KL divergence budget (this model's figure, measured or prior); without a figure,
        the backend's perplexity verdict (kvcache/quality.py)."""
        fig = self.backend.kld.figure(policy)
        if fig is None:
            return self.backend.quality.refusal(policy)
        if fig.mean_kld > self.req.max_kld:
            self.over_budget.append(f"{fig.format} ({fig.mean_kld:.3f} {fig.basis})")
            return f"{fig.describe()}: over the --max-kld {self.req.max_kld:g} budget"
        return None

    def quality_note(self, policy: KVPolicy) -> str:
        fig = self.backend.kld.figure(policy)
        if fig is None:
            return self.backend.quality.note(policy)
        return f"{fig.describe()}, within the --max-kld {self.req.max_kld:g} budget"

    def exact_fits(self, policy: KVPolicy) -> bool:
        refused = self.backend.refusals(policy)
        if refused:
            self.reject(policy, f"{self.backend.name} cannot: " + "; ".join(refused))
            return False
        if self.req.exact and not policy.exact:
            self.reject(policy, f"--exact allows full-precision KV only ({self.backend.describe(policy)})")
            return False
        poor = self.quality_refusal(policy) or self.unmeasured_split(policy)
        if poor:
            self.reject(policy, poor)
            return False
        if self.context > self.spec.context_length:
            self.reject(policy, f"holds all {self.context:,} tokens, past the {self.spec.context_length:,} "
                                f"{self.spec.name} was trained on (positions beyond it degrade); a window keeps "
                                "cache positions inside it")
            return False
        need = self.backend.kv_bytes(self.spec, policy, self.context)
        if need > self.budget.kv:
            self.reject(policy, f"KV for {self.context:,} tokens is {format_bytes(need)}, over the "
                                f"{format_bytes(max(self.budget.kv, 0))} budget")
            return False
        if self.req.min_tok_s:
            tok_s = self.speed.worst_decode_tok_s(self.spec, policy, self.context)
            if tok_s < self.req.min_tok_s * SPEED_MARGIN:
                self.reject(policy, f"decodes at ≈{tok_s:.0f} tok/s at {self.context:,} tokens, under the "
                                    f"--min-tok-s {self.req.min_tok_s:g} target (+{SPEED_MARGIN - 1:.0%} margin)")
                return False
        return True

    def unmeasured_split(self, policy: KVPolicy) -> str | None:
        """A K/V split meets a speed target only by measured speed: the roofline of a format the
        calibration never timed is no evidence against the ones it did."""
        if not (policy.split and self.req.min_tok_s) or self.speed.calibrated(policy):
            return None
        return (f"its decode speed is not measured on {self.backend.name} (localctx plan --calibrate), "
                f"and a --min-tok-s target needs a measured format")

    def window_limits(self, template: KVPolicy) -> dict[str, int]:
        """Each bound on the window: memory, trained context, default cap, speed target, the context."""
        fixed = template.sinks + template.heavy
        limits = {
            "trained context": self.spec.context_length - fixed,
            f"default cap (the cache holds half the trained {self.spec.context_length:,})": cache_cap(self.spec) - fixed,
            "requested context": self.context - fixed,
            "memory": self._memory_window(template),
        }
        if self.req.min_tok_s:
            unbounded = replace(template, window=None, sinks=0, heavy=0)
            held = self.speed.max_cached_tokens(self.spec, unbounded, self.req.min_tok_s * SPEED_MARGIN)
            limits[f"--min-tok-s {self.req.min_tok_s:g}"] = held - fixed
        return limits

    def _memory_window(self, template: KVPolicy) -> int:
        lo, hi = 0, max(1, self.context)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.backend.kv_bytes(self.spec, replace(template, window=mid), self.context) <= self.budget.kv:
                lo = mid
            else:
                hi = mid
        if self.backend.kv_bytes(self.spec, replace(template, window=hi), self.context) <= self.budget.kv:
            return hi
        return lo

    def lossy(self, template: KVPolicy) -> tuple[KVPolicy, str] | None:
        refused = self.backend.refusals(template)
        if refused:
            self.reject(_shape(template), f"{self.backend.name} cannot: " + "; ".join(refused), template)
            return None
        poor = self.quality_refusal(template) or self.unmeasured_split(template)
        if poor:
            self.reject(_shape(template), poor, template)
            return None
        limits = self.window_limits(template)
        if template.heavy:
            limits = {k: v * (HEAVY_FRACTION - 1) // HEAVY_FRACTION for k, v in limits.items()}
        bound, window = min(limits.items(), key=lambda kv: kv[1])
        if window < MIN_WINDOW:
            self.reject(_shape(template),
                        f"the window would be {max(window, 0):,} tokens (bound by {bound}); under {MIN_WINDOW}",
                        template)
            return None
        heavy = window // (HEAVY_FRACTION - 1) if template.heavy else 0
        return replace(template, window=window, heavy=heavy), bound


def plan(hw: HardwareProfile, spec: ModelSpec, req: PlanRequest, backend: BackendView,
         speed: SpeedModel | None = None) -> Plan:
    """The plan for ``spec`` on ``hw`` through ``backend``, or NoPlanFits with every reason."""
    speed = speed or SpeedModel(hw)
    context = req.context or spec.context_length
    if context < 16:
        raise UserError(f"--context {context} is too small; give at least 16 tokens")
    if req.min_tok_s is not None and req.min_tok_s <= 0:
        raise UserError(f"--min-tok-s {req.min_tok_s:g} must be positive")
    if not req.max_kld > 0:
        raise UserError(f"--max-kld {req.max_kld:g} must be positive (nats per token, e.g. 0.1)")
    b = budget(hw, spec, req, backend)
    s = _Search(hw, spec, req, backend, speed, context, b)
    head = [f"hardware: {hw.describe()}", b.describe()]
    if b.kv <= 0:
        raise NoPlanFits(
            f"{spec.name} does not fit {hw.name}: weights {format_bytes(spec.weight_bytes)} + runtime "
            f"{format_bytes(b.runtime)} + margin {format_bytes(b.margin)} exceed {b.limited_by} "
            f"{format_bytes(b.free)}; use a smaller or more quantized model", [])
    for policy in exact_candidates(speed):
        if s.exact_fits(policy):
            return _finish(s, policy, head + [_why_exact(policy, s)])
    if req.exact:
        raise NoPlanFits(f"no exact plan for {context:,} tokens of {spec.name} on {hw.name}; drop --exact, "
                         "lower --context or --min-tok-s", s.rejected)
    over = _over_budget(s)
    options = _window_options(s)
    if not options:
        raise NoPlanFits(f"no plan for {context:,} tokens of {spec.name} on {hw.name}"
                         + (f" ({over}, and no window fits)" if over else "")
                         + "; lower --context or --min-tok-s, raise --max-kld, or use a smaller model", s.rejected)
    best, bound = _widest(options)
    for other, other_bound in options:
        if other is best:
            continue
        if other.window < best.window:
            s.reject(other, f"window {other.window:,} (bound by {other_bound}) is smaller than {best}'s")
        else:
            s.reject(other, f"its window is at most 5% larger than {best}'s, at lower precision")
    why = (f"lossy: keeps the first {best.sinks} and the last {best.window:,} tokens"
           + (f" plus {best.heavy:,} heavy hitters" if best.heavy else "")
           + f" of a {context:,}-token stream; the window is bound by {bound}"
           + (f"; {s.quality_note(best)}" if best.quantized else ""))
    instead = [f"{over}: a window keeps the context within budget instead, or lower --context for full precision "
               "without one"] if over else []
    return _finish(s, best, head + [why, window_words(s.backend.kld, best)] + instead)


def _window_options(s: _Search) -> list[tuple[KVPolicy, str]]:
    """Each windowed shape the backend runs within the quality goals, sized to its largest window."""
    return [(p, bound) for t in lossy_templates(s.req.heavy) if (found := s.lossy(t)) for p, bound in [found]]


def _widest(options: list[tuple[KVPolicy, str]]) -> tuple[KVPolicy, str]:
    """The largest window; within 5% of it, the higher fidelity (the earlier template)."""
    widest = max(p.window for p, _ in options)
    return next((p, bd) for p, bd in options if p.window >= widest * 0.95)


def planned_window(hw: HardwareProfile, spec: ModelSpec, backend: BackendView, speed: SpeedModel | None,
                   text_tokens: int) -> KVPolicy | None:
    """The windowed policy this planner takes for ``spec`` on ``hw`` where a window is needed (the whole
    trained context asked for, as plan() sizes it), with its window cut to what a calibration text of
    ``text_tokens`` tokens can measure: half the text, so that the other half is predicted by a cache
    that has evicted (``localctx plan --calibrate-quality``; docs/quality.md "Windows"). None where no
    window fits or the text is too short for a useful one."""
    req = PlanRequest()
    s = _Search(hw, spec, req, backend, speed or SpeedModel(hw), spec.context_length, budget(hw, spec, req, backend))
    options = _window_options(s) if s.budget.kv > 0 else []
    if not options or text_tokens // 2 < MIN_WINDOW:
        return None
    best, _ = _widest(options)
    return replace(best, window=min(best.window, text_tokens // 2))


def window_words(kld: KldTable, policy: KVPolicy) -> str:
    """A windowed plan's measured window figure, quoted and not judged: a window trades old tokens, not
    precision, and is planned only where no format within --max-kld holds the context."""
    fig = kld.window_figure(policy)
    not_judged = ("not judged against --max-kld (a window drops old tokens rather than precision; it is taken "
                  "only where nothing within the budget holds the context)")
    if fig is None:
        return (f"window: KL divergence of a {window_key(policy)} window not measured for this model "
                f"(localctx plan --calibrate-quality measures the window planned here); {not_judged}")
    longer = (f"; this plan keeps {policy.window:,} tokens, so it evicts later than the measured window"
              if policy.window > fig.window else "")
    return f"window: {fig.describe()}{longer}; {not_judged}"


def _over_budget(s: _Search) -> str:
    """Which formats the KL divergence budget refused, if any (said beside the plan taken instead)."""
    if not s.over_budget:
        return ""
    return f"over the --max-kld {s.req.max_kld:g} budget: {', '.join(dict.fromkeys(s.over_budget))}"


def _why_exact(policy: KVPolicy, s: _Search) -> str:
    if policy.exact:
        return f"exact: full-precision KV for all {s.context:,} tokens fits"
    why = f"{s.backend.describe(policy)}: the most precise format that fits {s.context:,} tokens"
    if policy.split:
        why += (f"; keys at {policy.k_bits} bits, values at {policy.v_bits}: keys set every attention score "
                "and lose more to quantization than values (KIVI)")
    return why + "; " + s.quality_note(policy)


def _finish(s: _Search, policy: KVPolicy, reasons: list[str]) -> Plan:
    spec, ctx = s.spec, s.context
    tok_s = s.speed.worst_decode_tok_s(spec, policy, ctx)
    reasons.append(f"decode ≈ {tok_s:.0f} tok/s at {ctx:,} tokens ({s.speed.basis(policy)})")
    if s.req.min_tok_s:
        reasons.append(f"speed target {s.req.min_tok_s:g} tok/s met" + _target_cost(s, policy))
    kv = s.backend.kv_bytes(spec, policy, ctx)
    reasons.append(f"KV {format_bytes(kv)} peak of the {format_bytes(max(s.budget.kv, 0))} budget"
                   + cost.layout_note(spec, policy))
    reasons.extend(f"assumed: {a}" for a in spec.assumptions)
    fig, window = s.backend.kld.figure(policy), s.backend.kld.window_figure(policy)
    return Plan(backend=s.backend.name, policy=policy, context=ctx, kv_bytes=kv, weight_bytes=spec.weight_bytes,
                decode_tok_s=tok_s, prefill_tok_s=s.speed.prefill_tok_s(spec, min(ctx, 4096)),
                hardware=s.hw.name, reasons=reasons, rejected=s.rejected, kv_layout=s.backend.describe(policy),
                quality=fig.to_dict() if fig else None, window_quality=window.to_dict() if window else None)


def _target_cost(s: _Search, policy: KVPolicy) -> str:
    """What --min-tok-s changed: the plan without it, and the window or exactness given up."""
    try:
        free = plan(s.hw, s.spec, replace(s.req, min_tok_s=None), s.backend, s.speed)
    except NoPlanFits:
        return " (without the target no plan fits either)"
    if free.policy == policy:
        return " with no compromise (the plan without it is the same)"
    given_up = []
    if free.policy.exact and not policy.exact:
        given_up.append("exactness")
    if (free.policy.k_bits, free.policy.v_bits) != (policy.k_bits, policy.v_bits) and \
            free.policy.k_bits + free.policy.v_bits > policy.k_bits + policy.v_bits:
        given_up.append(f"precision ({free.policy.precision} → {policy.precision} KV)")
    kept_before, kept_now = free.policy.capacity(), policy.capacity()
    if kept_now is not None and (kept_before is None or kept_now < kept_before):
        before = "the whole context" if kept_before is None else f"{kept_before:,}"
        given_up.append(f"the cache keeps {kept_now:,} tokens instead of {before}")
    return (f"; it cost {', '.join(given_up) or 'a different policy'}: without the target the plan is "
            f"{free.policy} at ≈ {free.decode_tok_s:.0f} tok/s")
