"""What the planner needs from this machine and a backend: the hardware profile, the backend's
refusals, its calibration, and which backend a kind of hardware runs (docs/architecture.md "Backends")."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from localctx.backends import registry
from localctx.backends.base import Backend, Capabilities
from localctx.backends.machine.detect import resolve_hardware
from localctx.kvcache import calibration, cost, kld_quality, quality, quality_calibration
from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import HardwareProfile
from localctx.kvcache.plan import Plan
from localctx.kvcache.cost import layout_note
from localctx.kvcache.planner import BackendView, PlanRequest, budget, plan, window_words
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.speed import SpeedModel

BACKEND_FOR_KIND = {"apple": "mlx", "cuda": "torch", "cpu": "llamacpp"}


@dataclass(frozen=True)
class PlanningContext:
    hardware: HardwareProfile
    backend: BackendView
    speed: SpeedModel
    notes: tuple[str, ...] = ()


def choose_backend(requested: str, hw: HardwareProfile) -> str:
    if requested != "auto":
        return requested
    return registry.auto_name() if hw.detected else BACKEND_FOR_KIND[hw.kind]


def kld_table(name: str, spec: ModelSpec, model_file: Path | None) -> tuple[kld_quality.KldTable, tuple[str, ...]]:
    """This model's KL divergence figures on backend ``name``: its calibration (``localctx plan
    --calibrate-quality``) where one is cached for this file, else the committed priors; and a note
    when a cached calibration was ignored."""
    measured, windows, notes = {}, {}, ()
    if model_file is not None:
        cal, where = quality_calibration.load(model_file, name)
        if cal is not None:
            measured, windows = cal.kld_figures(where), cal.window_figures(where)
        elif where:
            notes = (where,)
    return kld_quality.KldTable(measured, kld_quality.priors_for(name, spec), windows), notes


def backend_view(name: str, spec: ModelSpec, model_file: Path | None = None,
                 hw: HardwareProfile | None = None) -> tuple[BackendView, tuple[str, ...]]:
    """The backend's refusals, from its class even where it cannot run (planning for another machine),
    this model's quality figures (``model_file``: its calibration, if cached), and on ``hw`` the KV
    element the backend holds there (Backend.kv_elem_bytes)."""
    cls = registry.backend_class(name)
    if cls is None:
        note = (f"backend {name} is not in this build: planned with full-precision KV only",)
        baseline = Capabilities()
        return BackendView(name, lambda policy: [
            f"{r} (the {name} backend is not in this build: only full-precision KV is assumed)"
            for r in baseline.refusals(policy)]), note
    backend: Backend = cls()
    backend.check_model(spec)
    kld, notes = kld_table(name, spec, model_file)
    return BackendView(name, lambda policy: backend.refusals(policy, spec), backend.kv_allocation(),
                       backend.describe_kv, quality.load(), kld,
                       backend.kv_elem_bytes(spec, hw) if hw is not None else None), notes


def calibration_name(name: str, hw: HardwareProfile) -> str:
    """What the backend's calibration for ``hw`` is stored under. Settings that change a backend's speed
    (the torch backend's dtype, weight format, threads) are this machine's, so they apply only to a
    detected machine; a named profile is looked up under the plain backend name."""
    cls = registry.backend_class(name)
    if cls is None or not hw.detected:
        return name
    return cls().calibration_name()


def speed_model(name: str, hw: HardwareProfile) -> SpeedModel:
    return SpeedModel(hw, calibration.load(calibration_name(name, hw), hw.key))


# the module that measures each backend's calibration: ``calibrate_and_save(progress)`` → (Calibration, path)
CALIBRATORS = {"llamacpp": "localctx.backends.llamacpp.calibrate", "torch": "localctx.backends.torch.calibrate"}


def calibrate_and_save(backend: str, progress=print) -> tuple[calibration.Calibration, Path]:
    """Measure ``backend`` on this machine (with its current settings) and store the calibration."""
    module = CALIBRATORS.get(backend)
    if module is None:
        raise UserError(f"--calibrate measures the {' or '.join(CALIBRATORS)} backend, not {backend}; "
                        f"add --backend {' or --backend '.join(CALIBRATORS)}")
    registry.get(backend)  # a one-line error when its packages are missing
    progress(f"calibrating {backend} decode cost per KV format (interleaved timing; about three minutes)...")
    return importlib.import_module(module).calibrate_and_save(progress=progress)


def model_refusal(name: str, spec: ModelSpec) -> str | None:
    """Why backend ``name``'s engine cannot run ``spec``'s architecture (None: it can, or it is not in this build)."""
    cls = registry.backend_class(name)
    return cls().capabilities().model_refusal(name, spec) if cls is not None else None


def planning_context(backend: str, spec: ModelSpec, hardware: str | None = None,
                     measure: bool = True, model_file: Path | None = None) -> PlanningContext:
    hw = resolve_hardware(hardware, measure=measure)
    name = choose_backend(backend, hw)
    fallback = ()
    if backend == "auto" and name != "llamacpp" and (why := model_refusal(name, spec)):
        fallback = (f"backend llamacpp, not {name}: {why.split(';')[0]}",)
        name = "llamacpp"
    view, notes = backend_view(name, spec, model_file, hw)
    return PlanningContext(hw, view, speed_model(name, hw), fallback + notes)


def plan_fixed(ctx: PlanningContext, spec: ModelSpec, policy: KVPolicy, req: PlanRequest) -> Plan:
    """A plan for a policy the user chose (``--kv``): refused before loading if it cannot fit."""
    context = req.context or spec.context_length
    b = budget(ctx.hardware, spec, req, ctx.backend)
    need = ctx.backend.kv_bytes(spec, policy, context)
    if need > b.kv:
        raise UserError(f"--kv {policy} needs {cost.format_bytes(need)} of KV for {context:,} tokens but only "
                        f"{cost.format_bytes(max(b.kv, 0))} is free for it ({b.describe()}); lower --context, "
                        "or choose a quantized or windowed --kv (or omit --kv to let localctx plan)")
    tok_s = ctx.speed.worst_decode_tok_s(spec, policy, context)
    layout = ctx.backend.describe(policy)
    fig = ctx.backend.kld.figure(policy)
    if fig is not None:
        over = fig.mean_kld > req.max_kld
        judged = [f"{fig.describe()}" + (f": over the --max-kld {req.max_kld:g} budget, used because --kv names it"
                                         if over else f", within the --max-kld {req.max_kld:g} budget")]
    else:
        judged = [ctx.backend.quality.refusal(policy) or ctx.backend.quality.note(policy)] if policy.quantized else []
    window = ctx.backend.kld.window_figure(policy)
    if policy.evicts:
        judged.append(window_words(ctx.backend.kld, policy))
    return Plan(quality=fig.to_dict() if fig else None, window_quality=window.to_dict() if window else None,
                backend=ctx.backend.name, policy=policy, context=context, kv_bytes=need, kv_layout=layout,
                weight_bytes=spec.weight_bytes, decode_tok_s=tok_s,
                prefill_tok_s=ctx.speed.prefill_tok_s(spec, min(context, 4096)), hardware=ctx.hardware.name,
                reasons=[f"KV policy {policy} from --kv ({layout})", b.describe(),
                         f"decode ≈ {tok_s:.0f} tok/s at {context:,} tokens ({ctx.speed.basis(policy)})",
                         f"KV {cost.format_bytes(need)} at {context:,} tokens" + layout_note(spec, policy)]
                + judged + [f"assumed: {a}" for a in spec.assumptions])


def make_auto_plan(ctx: PlanningContext, spec: ModelSpec, req: PlanRequest) -> Plan:
    p = plan(ctx.hardware, spec, req, ctx.backend, ctx.speed)
    p.reasons.extend(ctx.notes)
    return p


TABLE_HARDWARE = ("m1-8gb", "m3-pro-36gb", "m2-max-64gb", "rtx4090", "rtx4080", "cpu-24gb")
TABLE_MODELS = ("smollm2-135m", "llama-3-8b", "qwen2.5-7b", "llama-3.1-70b-q4")
TABLE_CONTEXTS = (4096, 32768, 131072)


@dataclass(frozen=True)
class DecisionRow:
    profile: str  # the named profile, e.g. "rtx4090"
    hardware: HardwareProfile
    spec: ModelSpec
    context: int
    budget_kv: int
    plan: Plan | None
    refusal: str = ""  # the headline when no plan fits
    rejected: tuple = ()


def decision_rows(hardware_names=TABLE_HARDWARE, model_names=TABLE_MODELS, contexts=TABLE_CONTEXTS,
                  backend: str = "auto") -> list[DecisionRow]:
    """The planner's decision for every named machine × known model × context (docs/planner.md)."""
    from localctx.backends.machine.detect import named
    from localctx.kvcache.known_models import known_spec
    from localctx.kvcache.planner import NoPlanFits

    rows = []
    for hw_name in hardware_names:
        hw = named(hw_name)
        for model in model_names:
            spec = known_spec(model)
            name = choose_backend(backend, hw)
            view, notes = backend_view(name, spec, hw=hw)
            ctx = PlanningContext(hw, view, speed_model(name, hw), notes)
            for c in contexts:
                req = PlanRequest(context=c)
                kv_budget = budget(hw, spec, req, view).kv
                try:
                    rows.append(DecisionRow(hw_name, hw, spec, c, kv_budget, make_auto_plan(ctx, spec, req)))
                except NoPlanFits as exc:
                    rows.append(DecisionRow(hw_name, hw, spec, c, kv_budget, None, exc.headline,
                                           tuple(exc.rejected)))
    return rows
