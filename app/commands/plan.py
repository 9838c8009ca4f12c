"""``localctx plan``: what would be chosen here (or on a named machine), the projected KV memory and
decode speed at 4K / 32K / 128K, and every rejected alternative with its reason. Plans a known
model shape (assets/models.json, e.g. ``-m llama-3-8b``) without its weights."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from localctx.app.session_options import (GROW_FROM_TOKENS, SessionRequest, add_session_options, make_plan,
                                          model_file, resolve_model)
from localctx.backends.models.ref import ModelRef
from localctx.backends.machine.detect import profile_names, resolve_hardware
from localctx.backends.models.spec_reader import hub_config_spec
from localctx.backends.models.ref import is_repo_id
from localctx.backends.machine.planner_inputs import calibrate_and_save, choose_backend, planning_context
from localctx.kvcache import known_models, reuse_projection
from localctx.kvcache.cost import format_bytes, full_bytes_per_token
from localctx.kvcache.errors import UserError
from localctx.kvcache.kld_quality import CALIBRATED_BACKENDS
from localctx.kvcache.planner import NoPlanFits, budget
from localctx.kvcache.projection import projection_contexts, projections
from localctx.kvcache.prompt_cache import CHUNK
from localctx.kvcache.model_spec import ModelSpec, describe_layout


def register(sub) -> None:
    p = sub.add_parser("plan", help="show the KV plan for a model here or on another machine, and why",
                       description="Show the KV-cache plan: chosen backend and policy, projected memory and speed, "
                                   "and each rejected alternative with its reason.")
    add_session_options(p)
    p.add_argument("--hardware", default=None, metavar="NAME",
                   help="plan for a named machine (rtx4090, m2-max-64gb, cpu-24gb, ...; default: this one)")
    p.add_argument("--heavy", action="store_true", help="also consider heavy-hitter (H2O) eviction")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the backend's decode cost per KV format on this machine first (llama.cpp by "
                        "default, about a minute; --backend torch: with its current settings, about two minutes)")
    p.add_argument("--calibrate-quality", action="store_true",
                   help="measure what each lossy KV format costs this model first (KL divergence and top-1 "
                        "against full precision on built-in text; a few minutes for a 0.5B model) and the window "
                        "the planner would take here (scored past it), cached per model file and backend; the plan "
                        "then judges formats by it (--max-kld) and quotes the window's figure")
    p.add_argument("--list-hardware", action="store_true", help="list the named hardware profiles")
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="also project the time to first token of an N-token prompt, cold and with a cached prefix")
    p.add_argument("--cached-tokens", type=int, default=None, metavar="M",
                   help="the cached prefix for that projection (default: all but the last 512 tokens, as a "
                        "prompt-cache file would hold)")
    p.set_defaults(handler=handle)


def model_spec(req: SessionRequest) -> tuple[ModelSpec, str, ModelRef | None]:
    """A local model's spec (a GGUF's header, a folder's config.json) and its ref, else a known shape
    from assets/models.json, else a hub repo's config.json alone (fetched when online): no weights needed."""
    try:
        ref, spec = resolve_model(req)
        return spec, "model file", ref
    except UserError as exc:
        spec = known_spec_or_none(req.model)
        if spec is not None:
            return spec, "assets/models.json (no weights needed)", None
        if req.model and is_repo_id(req.model):
            return hub_config_spec(req.model), f"config.json of {req.model} (no weights needed)", None
        raise UserError(f"{exc}; or plan a known shape: {', '.join(known_models.names())}") from None


def known_spec_or_none(name: str | None) -> ModelSpec | None:
    return known_models.known_spec(name) if name else None


def handle(args: argparse.Namespace) -> int:
    if args.list_hardware:
        print("\n".join(profile_names()))
        return 0
    req = SessionRequest.from_args(args)
    req.hardware, req.heavy = args.hardware, args.heavy
    if args.calibrate:
        _calibrate(args)
    if args.calibrate_quality:
        _calibrate_quality(req)
    if req.backend == "openai":  # the server plans, or keeps its own settings
        from localctx.app.session_options import remote_request
        from localctx.backends.openai.session import describe_remote

        return describe_remote(remote_request(req), as_json=args.json)
    spec, source, ref = model_spec(req)
    ctx = planning_context(req.backend, spec, hardware=req.hardware, model_file=model_file(ref))
    b = budget(ctx.hardware, spec, req.plan_request(), ctx.backend)
    try:
        plan = make_plan(req, spec, ctx)
    except NoPlanFits as exc:
        return _refused(args, spec, ctx, exc)
    rows = projections(plan, spec, ctx.speed, projection_contexts(spec, plan.context), b.kv, ctx.backend)
    ttft = _ttft(args, spec, ctx, plan)
    if args.json:
        print(json.dumps({"model": spec.to_dict(), "model_source": source, "hardware": ctx.hardware.to_dict(),
                          "plan": plan.to_dict(), "budget_kv_bytes": b.kv,
                          "calibration": ctx.speed.calibration.source if ctx.speed.calibration else None,
                          "projections": [r.__dict__ for r in rows], "decode_note": reuse_projection.DECODE_NOTE,
                          "ttft": [t.to_dict() for t in ttft]}, indent=2))
        return 0
    _print_plan(spec, source, ctx, plan, rows)
    for t in ttft:
        where = "cold" if not t.cached_tokens else f"{t.cached_tokens:,} tokens cached" + (
            f" (a prompt-cache file, ≈ {t.load_s:.2f} s to read)" if t.from_file else "")
        print(f"  time to first token, {t.prompt_tokens:,}-token prompt, {where}: ≈ {t.seconds:.2f} s")
    print(f"\nnote: {reuse_projection.DECODE_NOTE}")
    return 0


def _ttft(args: argparse.Namespace, spec, ctx, plan) -> list:
    """Cold and cached time-to-first-token projections for --prompt-tokens (empty without it)."""
    if args.prompt_tokens is None:
        return []
    if args.prompt_tokens < 1:
        raise UserError(f"--prompt-tokens {args.prompt_tokens} must be at least 1")
    n = args.prompt_tokens
    cached = args.cached_tokens if args.cached_tokens is not None else (n - 1) // CHUNK * CHUNK
    if not 0 <= cached < n:
        raise UserError(f"--cached-tokens {cached} must be between 0 and {n - 1} "
                        "(the last token is always prefilled)")
    out = [reuse_projection.projected_ttft(ctx.speed, spec, plan.policy, n)]
    if cached:
        out.append(reuse_projection.projected_ttft(ctx.speed, spec, plan.policy, n, cached, from_file=True))
    return [t for t in out if t is not None]


def _calibrate(args: argparse.Namespace) -> None:
    if args.hardware:
        raise UserError("--calibrate measures this machine; drop --hardware")
    backend = choose_backend(args.backend, resolve_hardware(None))
    cal, path = calibrate_and_save(backend, progress=lambda line: print(line, file=sys.stderr))
    print(f"calibration saved to {path}: {cal.note}", file=sys.stderr)


def _calibrate_quality(req: SessionRequest) -> None:
    """Measure every lossy format the backend offers on this model and cache it (one line when done)."""
    import resource
    import time

    from localctx.backends.evaluation.calibrate_quality import (calibrate, formats_for, measured_words, progress_bar,
                                                                 task_for, window_for, window_words)
    from localctx.kvcache import quality_calibration

    if req.hardware:
        raise UserError("--calibrate-quality measures the model on this machine; drop --hardware")
    chosen = ""
    if req.backend == "auto":  # the backend run and chat take here, named in the first line
        from localctx.backends import registry

        req = dataclasses.replace(req, backend=registry.auto_name())
        chosen = " (the backend run and chat use here; --backend picks another)"
    if req.backend not in CALIBRATED_BACKENDS:
        raise UserError(f"--calibrate-quality needs --backend llamacpp, torch or mlx (got {req.backend}): "
                        "each backend's cache loses differently, so each is calibrated apart")
    ref, spec = resolve_model(req)
    formats = ", ".join(map(str, formats_for(req.backend, spec)))
    task, window = task_for(req.backend), window_for(req.backend, spec, ref)
    print(f"calibrating KV quality of {spec.name} on {req.backend}{chosen}: {formats} against full precision, "
          f"{measured_words(task, spec)}, in lockstep"
          + (f"; then the window planned here, {window_words(task, window)}" if window else
             "; no window (none fits here, or the text is too short for one)"), file=sys.stderr)
    started = time.perf_counter()
    cal = calibrate(req.backend, ref, spec, on_chunk=progress_bar(), window=window)
    path = quality_calibration.save(cal, ref.path)
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    print(f"quality calibration saved to {path} ({time.perf_counter() - started:.0f} s wall, "
          f"{cpu.ru_utime + cpu.ru_stime:.0f} s CPU): "
          + ", ".join(f"{fmt} KLD {f['mean_kld']:.4f}" for fmt, f in {**cal.figures, **cal.windows}.items()),
          file=sys.stderr)


def _print_plan(spec, source, ctx, plan, rows) -> None:
    print(f"model     {spec.name}: {spec.n_layers} layers, {spec.n_kv_heads} KV heads × {spec.head_dim}, trained "
          f"{spec.context_length:,} tokens, weights {format_bytes(spec.weight_bytes)}, "
          f"KV {format_bytes(full_bytes_per_token(spec))}/token at fp16 before windows  [{source}]")
    print(f"attention {describe_layout(spec)}")
    for assumption in spec.assumptions:
        print(f"assumed   {assumption}")
    print(f"hardware  {ctx.hardware.describe()}")
    print(f"backend   {plan.backend}")
    print(f"policy    {plan.policy}  ({plan.kv_layout})")
    if plan.quality:
        print(f"quality   {figure_line(plan.quality)}")
    if plan.window_quality:
        print(f"window    {figure_line(plan.window_quality)} (quoted, not judged against --max-kld)")
    print(f"context   {plan.context:,} tokens; KV {format_bytes(plan.kv_bytes)} + weights "
          f"{format_bytes(plan.weight_bytes)}; decode ≈ {plan.decode_tok_s:.1f} tok/s"
          + (f", prefill ≈ {plan.prefill_tok_s:.0f} tok/s" if plan.prefill_tok_s else ""))
    if not plan.policy.evicts:
        print(allocation_line(plan.backend))
    print("\nprojected with this policy:")
    print(f"  {'context':>9}  {'KV memory':>10}  {'decode tok/s':>12}  fits")
    for r in rows:
        print(f"  {r.context:>9,}  {format_bytes(r.kv_bytes):>10}  {r.decode_tok_s:>12.1f}  {'yes' if r.fits else 'no'}")
    print("\nwhy:")
    for reason in plan.reasons:
        print(f"  - {reason}")
    if plan.rejected:
        print("\nrejected:")
        _print_rejected(plan.rejected)


def allocation_line(backend: str) -> str:
    """How the named backend allocates the KV up to the plan's context."""
    from localctx.backends import registry

    cls = registry.backend_class(backend)
    if cls is not None and not cls.kv_reserved_at_load:
        return ("allocated as the cache fills, up to the context above: nothing is reserved at load; the "
                "buffers grow as tokens arrive (the stats line says what they take)")
    return (f"allocated as the work needs it, up to the context above: run, its prompt + --max-tokens; chat, "
            f"{GROW_FROM_TOKENS:,} tokens, doubling as the conversation grows")


def figure_line(q: dict) -> str:
    how = (f"{q['basis']} with window {q['window']:,}, scored at the {q['tokens']:,} positions past it"
           if q.get("window") else q["basis"])
    return (f"KLD {q['mean_kld']:.4f} nats/token (p99 {q['p99_kld']:.3f}), top-1 {q['top1']:.1%}, "
            f"{how}: {q['source']}")


def _print_rejected(rejected) -> None:
    for r in rejected:
        print(f"  - {r.policy}: {r.reason}")
        if r.quality and "KLD" not in r.reason:
            print(f"      quality: {figure_line(r.quality)}")


def _refused(args, spec, ctx, exc: NoPlanFits) -> int:
    if args.json:
        print(json.dumps({"model": spec.to_dict(), "hardware": ctx.hardware.to_dict(), "plan": None,
                          "refused": exc.headline, "rejected": [r.__dict__ for r in exc.rejected]}, indent=2))
    else:
        print(f"no plan: {exc.headline}")
        _print_rejected(exc.rejected)
    return exc.exit_code
