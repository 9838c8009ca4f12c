"""``localctx eval``: what a KV policy costs in quality on your model — perplexity of a long text
streamed through the policy's cache, passkey retrieval over context lengths × depths, and with
``--tasks`` the long-context tasks of backends/evaluation/long_tasks.py — each policy beside the
full-precision cache of the same backend: torch (its policy caches), llama.cpp (its own cache
types, f16 / q8_0 / q4_0, and its context shift for a window) or MLX (its policy caches)."""
from __future__ import annotations

import argparse
import json
import sys

from localctx.app.session_options import SessionRequest, add_model_option, resolve_model
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.errors import UserError
from localctx.kvcache.policy import KVPolicy


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, needle retrieval and long-context tasks of KV policies against full precision",
                       description="Measure what each KV policy costs in quality, beside the full-precision cache.")
    add_model_option(p)
    p.add_argument("--backend", choices=("torch", "llamacpp", "mlx"), default="torch",
                   help="whose KV cache to measure: torch's policy caches (default), llama.cpp's cache types, "
                        "or MLX's policy caches")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="llama.cpp threads (default: the physical cores; several caches in lockstep decode one "
                        "thread each, N at once; torch reads LOCALCTX_TORCH_THREADS)")
    p.add_argument("--kv", action="append", default=[], metavar="POLICY",
                   help="a KV policy to evaluate (repeatable), e.g. int8, int4+res128, int4+sink4+win2048")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of text streamed for perplexity (default 8192)")
    p.add_argument("--chunk", type=int, default=128,
                   help="tokens per forward while streaming text or a passkey prompt (default 128)")
    p.add_argument("--score-from", type=int, default=0, metavar="N",
                   help="score only the predictions of tokens N.. (e.g. past the trained context)")
    p.add_argument("--segment", type=int, default=0, metavar="N", help="also report perplexity per N tokens")
    p.add_argument("--needle-lengths", default="1024,2048,4096", metavar="L1,L2",
                   help="passkey prompt lengths in tokens (default 1024,2048,4096)")
    p.add_argument("--needle-depths", default="0.1,0.5,0.9", metavar="D1,D2", help="key depths in [0, 1]")
    p.add_argument("--tasks", default="", metavar="T1,T2",
                   help="also run long-context tasks at --lengths: niah_multikey, niah_multivalue, vt, cwe "
                        "(RULER-style, generated from --seed)")
    p.add_argument("--lengths", default="2048,4096", metavar="L1,L2",
                   help="prompt lengths in tokens for --tasks (default 2048,4096)")
    p.add_argument("--samples", type=int, default=1, metavar="N", help="samples per task and length (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the seed --tasks' prompts are generated from (default 0)")
    p.add_argument("--no-perplexity", action="store_true", help="skip the perplexity run")
    p.add_argument("--no-needle", action="store_true", help="skip the passkey grid")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the full-precision run (when another run of the same task measured it)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(handler=handle)


def _numbers(text: str, kind, what: str) -> tuple:
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{what} {text!r} must be comma-separated numbers, e.g. 1024,2048") from None
    if not values:
        raise UserError(f"{what} is empty; give at least one value")
    return values


def tasks_from(args: argparse.Namespace, long_tasks: bool = False):
    from localctx.backends.evaluation.tasks import NeedleTask, PerplexityTask

    if args.chunk < 1:
        raise UserError(f"--chunk {args.chunk} must be at least 1")
    if args.no_perplexity and args.no_needle and not long_tasks:
        raise UserError("--no-perplexity and --no-needle leave nothing to measure; drop one or give --tasks")
    ppl = None
    if not args.no_perplexity:
        if args.tokens < 64:
            raise UserError(f"--tokens {args.tokens} is too few for a perplexity; give at least 64")
        if not 0 <= args.score_from < args.tokens - 1:
            raise UserError(f"--score-from {args.score_from} must lie inside the {args.tokens} tokens")
        ppl = PerplexityTask(args.tokens, args.chunk, args.score_from, max(0, args.segment))
    needle = None
    if not args.no_needle:
        lengths = _numbers(args.needle_lengths, int, "--needle-lengths")
        depths = _numbers(args.needle_depths, float, "--needle-depths")
        if min(lengths) < 128:
            raise UserError("--needle-lengths must be at least 128 tokens each")
        if not all(0 <= d <= 1 for d in depths):
            raise UserError("--needle-depths must lie in [0, 1] (0 = start of the context, 1 = end)")
        needle = NeedleTask(lengths, depths, chunk=max(1, args.chunk))
    return ppl, needle


def suite_from(args: argparse.Namespace):
    """The long-context tasks of --tasks, or None."""
    from localctx.backends.evaluation.long_tasks import TASKS, TaskSuite

    names = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if not names:
        return None
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise UserError(f"--tasks {','.join(unknown)}: unknown; choose from {','.join(TASKS)}")
    lengths = _numbers(args.lengths, int, "--lengths")
    if min(lengths) < 256:
        raise UserError("--lengths must be at least 256 tokens each")
    if args.samples < 1:
        raise UserError(f"--samples {args.samples} must be at least 1")
    return TaskSuite(names, lengths, args.samples, args.seed, max(1, args.chunk))


def handle(args: argparse.Namespace) -> int:
    policies = [KVPolicy.parse(text) for text in args.kv]
    if args.no_baseline and not policies:
        raise UserError("--no-baseline with no --kv leaves nothing to measure; give --kv POLICY")
    suite = suite_from(args)
    ppl, needle = tasks_from(args, suite is not None)
    if args.threads is not None and (args.backend != "llamacpp" or args.threads < 1):
        raise UserError(f"--threads {args.threads} needs --backend llamacpp and at least 1 "
                        "(torch's threads: LOCALCTX_TORCH_THREADS)")
    if args.backend == "llamacpp":
        from localctx.backends.llamacpp.evaluate import LlamaCppEvaluator, evaluate

        ref, _ = resolve_model(SessionRequest(model=args.model, backend="llamacpp"))
        evaluator = LlamaCppEvaluator(ref, threads=args.threads)
    elif args.backend == "mlx":
        from localctx.backends.registry import get

        get("mlx")  # one line naming what to install where MLX is missing, before importing it
        from localctx.backends.mlx.evaluate import MLXEvaluator, evaluate

        ref, _ = resolve_model(SessionRequest(model=args.model, backend="mlx"))
        evaluator = MLXEvaluator(ref, chunk=max(1, args.chunk))
    else:
        from localctx.backends.torch.loading import TorchOptions, load_model
        from localctx.backends.torch.evaluate import PolicyEvaluator, evaluate

        ref, _ = resolve_model(SessionRequest(model=args.model, backend="torch"))
        loaded = load_model(ref, TorchOptions.from_env())
        evaluator = PolicyEvaluator(loaded.model, loaded.tokenizer)
    progress = None if args.json else (lambda r: print(f"  measured {progress_line(r)}", file=sys.stderr, flush=True))
    reports = evaluate(evaluator, policies, ppl, needle, progress, baseline=not args.no_baseline, suite=suite)
    if args.json:
        print(json.dumps(as_json(ref.name, ppl, needle, reports, args.backend) | tasks_json(suite, reports), indent=2))
    else:
        if ppl or needle:
            print(table(ref.name, ppl, needle, reports, args.backend))
        if suite:
            print(tasks_table(suite, reports))
    return 0


def progress_line(r) -> str:
    parts = [r.policy]
    if r.perplexity:
        parts.append(f"ppl {r.perplexity.ppl:.3f} ({r.perplexity.seconds:.0f} s)")
    if r.needle:
        parts.append(f"passkey {r.needle.hits}/{r.needle.total} ({r.needle.seconds:.0f} s)")
    if r.long_tasks:
        hits = sum(row["hit"] for row in r.long_tasks.rows)
        parts.append(f"tasks {hits}/{len(r.long_tasks.rows)} ({r.long_tasks.seconds:.0f} s)")
    return ", ".join(parts)


def tasks_json(suite, reports) -> dict:
    """--tasks in --json: the suite, and per policy the summary per task and length and every sample."""
    from dataclasses import asdict

    if not suite:
        return {}
    return {"tasks_suite": asdict(suite),
            "tasks": [{"policy": r.policy, "exact": r.exact, "summary": r.long_tasks.summary(),
                       "samples": r.long_tasks.rows, "seconds": r.long_tasks.seconds} for r in reports]}


def tasks_table(suite, reports) -> str:
    """One line per task and length: each policy's hits / samples and mean score, the baseline first."""
    head = f"{'task':<16} {'length':>7} " + " ".join(f"{r.policy:>22}" for r in reports)
    lines = [f"long-context tasks: {suite.samples} sample(s) each, seed {suite.seed}; hits/samples (mean score)",
             head, "-" * len(head)]
    summaries = [{(s["task"], s["length"]): s for s in r.long_tasks.summary()} for r in reports]
    for key in summaries[0]:
        cells = [f"{s[key]['hits']}/{s[key]['samples']} ({s[key]['score']:.2f})" for s in summaries]
        lines.append(f"{key[0]:<16} {key[1]:>7} " + " ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def as_json(model: str, ppl, needle, reports, backend: str = "torch") -> dict:
    from dataclasses import asdict

    def row(r) -> dict:
        out = {"policy": r.policy, "exact": r.exact}
        if r.backend_settings:  # llama.cpp: its cache types, n_ctx and allocated bytes
            out["cache"] = r.backend_settings
        out["perplexity"] = asdict(r.perplexity) if r.perplexity else None
        out["divergence"] = asdict(r.divergence) if r.divergence else None  # KL from the full-precision cache
        out["needle"] = (asdict(r.needle) | {"accuracy": r.needle.accuracy}) if r.needle else None
        return out

    return {"model": model, "backend": backend,
            "perplexity_task": asdict(ppl) if ppl else None, "needle_task": asdict(needle) if needle else None,
            "policies": [row(r) for r in reports]}


def table(model: str, ppl, needle, reports, backend: str = "torch") -> str:
    base = reports[0] if reports[0].exact else None
    lines = [f"model {model}, {backend} backend"]
    if ppl:
        lines.append(f"perplexity: {ppl.n_tokens} tokens of pydoc_data.topics streamed in chunks of {ppl.chunk}, "
                     f"scored from token {max(1, ppl.score_from)}")
    if needle:
        lines.append(f"passkey: lengths {','.join(map(str, needle.lengths))} x depths "
                     f"{','.join(map(str, needle.depths))}, exact match")
    head = (f"{'policy':<28} {'kind':<6} {'ppl':>9} {'vs fp':>8} {'KLD mean':>9} {'p99':>8} {'top-1':>7} "
            f"{'needle':>8} {'vs fp':>7} {'KV held':>11} {'s':>6}")
    lines += [head, "-" * len(head)]
    for r in reports:
        p, n = r.perplexity, r.needle
        ppl_s = f"{p.ppl:9.3f}" if p else f"{'-':>9}"
        dppl = f"{(p.ppl / base.perplexity.ppl - 1) * 100:+7.2f}%" if p and base else f"{'-':>8}"
        acc = f"{n.hits}/{n.total}" if n else "-"
        dacc = f"{(n.accuracy - base.needle.accuracy) * 100:+6.1f}" if n and base else "-"
        held = format_bytes(p.kv_bytes) if p else "-"
        secs = (p.seconds if p else 0) + (n.seconds if n else 0)
        lines.append(f"{r.policy:<28} {'exact' if r.exact else 'lossy':<6} {ppl_s} {dppl} {kld_cells(r, base)} "
                     f"{acc:>8} {dacc:>7} {held:>11} {secs:6.0f}")
        for a, b, seg in (p.segments if p else []):
            lines.append(f"    tokens {a:>6}-{b:<6} ppl {seg:9.3f}")
    if ppl and base:
        lines.append("KLD: KL(full precision || policy) of the next-token distribution in nats, mean and 99th "
                     "percentile over the scored tokens; top-1: the two caches' most likely tokens agree")
    return "\n".join(lines)


def kld_cells(r, base) -> str:
    """KL divergence mean, p99 and top-1 agreement; the full-precision row is the reference."""
    d = r.divergence
    if d is None:
        return f"{'ref' if r is base else '-':>9} {'-':>8} {'-':>7}"
    return f"{d.mean_kld:9.5f} {d.p99_kld:8.4f} {d.top1 * 100:6.2f}%"
