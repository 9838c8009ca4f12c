"""``localctx run``: one-shot generation. The answer streams to stdout, one stats line to stderr."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from localctx.app.startup_timings import Stopwatch, since_process_start
from localctx.app.session_options import (SessionRequest, add_prompt_cache_option, add_session_options,
                                          calibration_offer, plan_session)
from localctx.backends.generation import speculation
from localctx.backends.base import GenerationParams, GenerationStats, OutputConstraint
from localctx.kvcache.cost import format_bytes
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan


def register(sub) -> None:
    p = sub.add_parser("run", help="answer one prompt (argument and/or stdin)",
                       description="Answer one prompt. Stdin, if any, comes first, then the argument.")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt (stdin is prepended when piped)")
    add_session_options(p)
    add_prompt_cache_option(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens to generate (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-text up to --max-tokens (for timing a fixed length)")
    p.add_argument("--speculate", default="auto", choices=speculation.MODES,
                   help="prompt-lookup drafts verified several tokens per step: auto (default; plain decoding "
                        "where the KV policy cannot roll a draft back exactly), ngram, off")
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="answer with JSON valid against this JSON Schema (sampled under its grammar; docs/serve.md)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, stats, policy, backend)")
    p.add_argument("--timings", action="store_true",
                   help="say where the start-up time went (imports, header, profile, plan, load, template, first "
                        "token) on stderr, or under \"timings\" with --json")
    p.set_defaults(handler=handle)


def read_prompt(arg: str | None, stdin=None) -> str:
    stdin = sys.stdin if stdin is None else stdin
    parts = []
    if stdin is not None and not stdin.isatty():
        piped = stdin.read()
        if piped.strip():
            parts.append(piped.rstrip("\n"))
    if arg is not None and arg.strip():
        parts.append(arg)
    text = "\n\n".join(parts)
    if not text.strip():
        raise UserError('the prompt is empty: localctx run "your question" (or pipe text on stdin)')
    return text


def params_from(args: argparse.Namespace) -> GenerationParams:
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens {args.max_tokens} must be at least 1")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature} must be 0 (greedy) or more")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p} must be in (0, 1]")
    if args.top_k < 0:
        raise UserError(f"--top-k {args.top_k} must be 0 (off) or more")
    return GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), speculate=args.speculate,
                            ignore_eos=args.ignore_eos)


def read_schema(path: str) -> OutputConstraint:
    """``--json-schema FILE`` as the answer's constraint; one line for a file that cannot be used."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"--json-schema {path}: cannot read it ({exc.strerror or exc}); "
                        "give a readable JSON Schema file") from None
    except UnicodeDecodeError:
        raise UserError(f"--json-schema {path}: not UTF-8 text; give a JSON Schema file") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise UserError(f"--json-schema {path}: not JSON ({exc}); give a JSON Schema file") from None
    if not isinstance(schema, dict):
        raise UserError(f"--json-schema {path}: a JSON Schema is an object ({{\"type\": ...}}), not "
                        f"{type(schema).__name__}") from None
    return OutputConstraint.json_schema(json.dumps(schema), field=f"--json-schema {path}")


def speculation_words(stats: GenerationStats) -> str:
    """", prompt lookup 2.4 tok/step (31 of 40 drafted accepted)", ", prompt lookup drafted nothing" (no
    text to copy from, or no draft worth its verify cost), or ", prompt lookup off" where auto
    could not run it exactly (the reason is in --json's stats.speculate: one line stays short)."""
    if stats.speculate == "ngram" and not stats.drafted_tokens:  # each step was plain: no tok/step to show
        return ", prompt lookup drafted nothing"
    if stats.speculate == "ngram":
        return (f", prompt lookup {stats.tokens_per_step:.2f} tok/step "
                f"({stats.accepted_tokens} of {stats.drafted_tokens} drafted accepted)")
    if stats.speculate == f"off ({speculation.NO_EXACT_ROWS})":  # asked for, and no draft would keep the text
        return ", prompt lookup off (no exact verify rows for this model and KV here)"
    return ", prompt lookup off" if stats.speculate.startswith("off (") else ""


def prompt_cache_words(stats: GenerationStats) -> str:
    """", 984 of 986 prompt tokens from the prompt cache" where the prompt's start was read from disk
    (the prefill figure counts only the tokens prefilled after it)."""
    if not stats.loaded_tokens:
        return ""
    return f", {stats.loaded_tokens:,} of {stats.prompt_tokens:,} prompt tokens from the prompt cache"


def stats_line(stats: GenerationStats, plan: Plan, finish: str) -> str:
    allocated = (f" of {format_bytes(plan.allocated_bytes)} allocated ({plan.allocated_context:,} tokens; "
                 f"{format_bytes(plan.kv_bytes)} at {plan.context:,})" if plan.allocated_context < plan.context else "")
    return (f"[{stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated, "
            f"prefill {stats.prefill_tok_s:.1f} tok/s, decode {stats.decode_tok_s:.1f} tok/s"
            f"{speculation_words(stats)}{prompt_cache_words(stats)}, "
            f"KV {format_bytes(stats.kv_bytes)}{allocated}, policy {stats.policy} "
            f"({'exact' if plan.exact else 'lossy'}), backend {stats.backend}, finish {finish}]")


TEMPLATE_TOKENS = 128  # room for the chat template's own tokens (role markers, a default system message)


def request_tokens(text: str, system: str | None, max_tokens: int) -> int:
    """The tokens this request may hold, from above: a token stands for at least one byte of the prompt, plus
    the template's tokens and the answer. A template longer than that grows the context (session.fit)."""
    return len(text.encode("utf-8")) + len((system or "").encode("utf-8")) + TEMPLATE_TOKENS + max_tokens


def handle(args: argparse.Namespace) -> int:
    watch = Stopwatch()
    if args.timings:
        started = since_process_start()
        if started is not None:
            watch.stages["interpreter and imports"] = started
    text = read_prompt(args.prompt)
    params = params_from(args)
    constraint = read_schema(args.json_schema) if args.json_schema else None
    messages = text if args.raw else (
        ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}])
    request = dataclasses.replace(SessionRequest.from_args(args, prompt_cache=args.prompt_cache),
                                  allocate=request_tokens(text, args.system, args.max_tokens))
    watch.lap("prompt")
    planned = plan_session(request, watch)  # open_session's two steps, with the calibration offer between
    offer = calibration_offer(planned)
    if offer:
        print(offer, file=sys.stderr)
    session = planned.load(watch)
    if constraint is not None:
        reason = session.constraint_refusal(constraint)
        if reason:
            session.close()
            raise UserError(reason)
        params = dataclasses.replace(params, constraint=constraint)
    pieces: list[str] = []
    last = None
    code = 0
    try:
        with session:
            for event in session.generate(messages, params):
                if last is None:
                    watch.lap("template, prefill and first token")
                last = event
                if event.text:
                    pieces.append(event.text)
                    if not args.json:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
    except KeyboardInterrupt:
        code = 130
    watch.lap("rest of the answer")
    finish = "cancelled" if code else (last.finish_reason if last else "cancelled")
    stats = last.stats if last else None
    if args.json:
        out = {"text": "".join(pieces), "finish_reason": finish, "backend": session.plan.backend,
               "policy": str(session.plan.policy), "exact": session.plan.exact,
               "model": session.spec.name, "kv_layout": session.plan.kv_layout,
               "planned_kv_bytes": session.plan.kv_bytes, "context": session.plan.context,
               "allocated_context": session.plan.allocated_context, "allocated_kv_bytes": session.plan.allocated_bytes,
               "stats": (stats.to_dict() | {"kv_quality": session.plan.quality}) if stats else None}
        if args.timings:
            out["timings"] = {name: round(seconds, 4) for name, seconds in watch.stages.items()}
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stats is not None:
            print(stats_line(stats, session.plan, finish), file=sys.stderr)
        if args.timings:
            print(watch.line(), file=sys.stderr)
    return code
