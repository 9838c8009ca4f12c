"""``localctx bench``: speed and memory against context length for each backend × KV policy, beside
plain llama.cpp measured in the same run, as a table, a JSON file and PNG plots (see app/bench/)."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console

from localctx.app.bench import plots
from localctx.app.bench.assemble import SCHEMA, RunInfo, build_result
from localctx.app.bench.docs import write_doc
from localctx.app.bench.machine import describe_machine, load_average
from localctx.app.bench.projection import Projector
from localctx.app.bench.report import print_report
from localctx.app.bench.schedule import make_lineup, run_bench
from localctx.app.bench.settings import (DEFAULT_CONTEXTS, DEFAULT_POLICIES, BenchSettings, context_label,
                                         parse_contexts, policies_from)
from localctx.app.session_options import SessionRequest, add_model_option, resolve_model
from localctx.backends import registry
from localctx.kvcache.errors import UserError

RESULT_JSON = "bench.json"


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure speed and memory against context length (vs plain llama.cpp)",
                       description="Measure prefill/decode tok/s and KV memory against context length for each "
                                   "backend and KV policy, beside plain llama-cpp-python measured in the same run.")
    add_model_option(p)
    p.add_argument("--backend", action="append", default=None, metavar="B",
                   help="backend to measure (repeatable or comma-separated; default: auto)")
    p.add_argument("--kv", action="append", default=None, metavar="POLICY",
                   help="KV policy (repeatable or comma-separated; default: " + ",".join(DEFAULT_POLICIES) + ")")
    p.add_argument("--contexts", default=DEFAULT_CONTEXTS, help=f"context lengths (default {DEFAULT_CONTEXTS})")
    p.add_argument("--runs", type=int, default=3, help="runs per point; medians are reported (default 3)")
    p.add_argument("--gen-tokens", type=int, default=32, help="tokens decoded per measurement (default 32)")
    p.add_argument("--max-minutes", type=float, default=None, metavar="M",
                   help="start no further run once another would pass M minutes (each run covers every series "
                        "and context, so the runs made stay paired); the report says how many were made")
    p.add_argument("--out", default="bench-out", help="output folder for bench.json and the plots")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="redraw the table and plots from a saved bench.json instead of measuring")
    p.add_argument("--doc", default=None, metavar="FILE.md",
                   help="also write a markdown page (beside it, the plots copied to img/ and bench.json to "
                        "results/bench/)")
    p.add_argument("--note", default=None, help="a remark about this run, kept in bench.json and shown on the --doc page")
    p.set_defaults(handler=handle)


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for text in values or [] for v in text.split(",") if v.strip()]


def settings_from(args: argparse.Namespace) -> BenchSettings:
    from localctx.backends.llamacpp.session import default_threads

    backends = _split(args.backend) or ["auto"]
    backends = list(dict.fromkeys(registry.auto_name() if b == "auto" else b for b in backends))
    for b in backends:
        if b not in registry.names():
            raise UserError(f"unknown backend {b!r}; choose from {', '.join(registry.names())} or auto")
    settings = BenchSettings(model=args.model, backends=backends,
                             policies=policies_from(_split(args.kv) or list(DEFAULT_POLICIES)),
                             contexts=parse_contexts(args.contexts), runs=args.runs, gen_tokens=args.gen_tokens,
                             out=args.out, threads=default_threads(), max_minutes=args.max_minutes)
    settings.check()
    return settings


def command_line(settings: BenchSettings, doc: str | None) -> str:
    """The command that reproduces this run, every setting spelled out."""
    words = ["localctx", "bench"] + (["-m", settings.model] if settings.model else [])
    words += ["--backend", ",".join(settings.backends), "--kv", ",".join(settings.policies),
              "--contexts", ",".join(context_label(c) for c in settings.contexts), "--runs", str(settings.runs),
              "--gen-tokens", str(settings.gen_tokens)]
    words += (["--max-minutes", f"{settings.max_minutes:g}"] if settings.max_minutes else [])
    words += ["--out", settings.out] + (["--doc", doc] if doc else [])
    return shlex.join(words)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def measure_all(args: argparse.Namespace, err: Console) -> dict:
    settings = settings_from(args)
    ref, spec = resolve_model(SessionRequest(model=settings.model, backend=settings.backends[0]))
    lineup = make_lineup(settings, ref, spec)
    machine = describe_machine()
    projector = Projector(spec, settings.backends)  # detects the hardware (bandwidth measured once, cached)
    started, t0 = _now(), time.perf_counter()
    outcome = run_bench(settings, lineup, spec.context_length, err)
    machine["load_average_end"] = load_average()
    info = RunInfo(command=command_line(settings, args.doc), started=started, finished=_now(),
                   duration_s=time.perf_counter() - t0, machine=machine, llama_cpp_version=_llama_cpp_version())
    return build_result(settings, lineup, outcome, ref, spec, info, projector)


def _llama_cpp_version() -> str | None:
    try:
        from localctx.app.bench.baseline import llama_cpp_version

        return llama_cpp_version()
    except ImportError:
        return None


def load_saved(path: str) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--from-json {path}: cannot read a bench result ({exc}); give a bench.json that "
                        "localctx bench wrote") from None
    if not isinstance(result, dict) or not str(result.get("schema", "")).startswith("localctx.bench/"):
        raise UserError(f"--from-json {path} is not a localctx bench result; give a bench.json from --out")
    if result["schema"] != SCHEMA:
        raise UserError(f"--from-json {path} was written by another version of localctx bench ({result['schema']}, "
                        f"this one reads {SCHEMA}); run the bench again")
    return result


def handle(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    if not args.from_json:
        return write_outputs(measure_all(args, err), args, err)
    result = load_saved(args.from_json)
    try:
        return write_outputs(result, args, err)
    except (KeyError, TypeError) as exc:  # a hand-edited or truncated saved file
        raise UserError(f"--from-json {args.from_json} is missing {exc} (edited or truncated?); "
                        "run the bench again") from None


def write_outputs(result: dict, args: argparse.Namespace, err: Console) -> int:
    if args.note:
        result["note"] = args.note
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = []
    (out / RESULT_JSON).write_text(json.dumps(result, indent=1) + "\n")  # saved before anything can fail
    print_report(result, Console(width=200) if not sys.stdout.isatty() else Console())
    if not args.no_plots:
        result["plots"] = [p.name for p in plots.draw(result, out)]
        (out / RESULT_JSON).write_text(json.dumps(result, indent=1) + "\n")
    err.print(f"wrote {out / RESULT_JSON}" + "".join(f", {out / p}" for p in result["plots"]))
    if args.doc:
        err.print(f"wrote {write_doc(result, out, Path(args.doc), out / RESULT_JSON)}")
    return 0
