"""A chat that grows past its first allocation answers as one that allocated the maximum from the
start: the check tests/backends/test_kv_growth.py makes on tiny models, made on real ones at the
chat's own threshold. Two sessions of one model and backend (greedy, fp16 policy): one allocates the
chat's first allocation (app/session_options.GROW_FROM_TOKENS, 4,096 tokens) and grows, the other
allocates the plan's whole context at load. Both hold the same two-turn conversation about a long
document (this repository's docs/architecture.md: the first turn's prompt fits the first
allocation, the second turn's does not); their answers must be the same tokens, and the second
turn must reuse the first's cache. Writes JSON with each turn's tokens, cached tokens and the
allocations before and after.

    python benchmarks/speed/growth_identity.py -m MODEL [-m MODEL ...] --backend llamacpp --backend torch
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = ROOT / "docs" / "architecture.md"


def conversation_texts(count_tokens, first_tokens: int, second_tokens: int) -> tuple[str, str]:
    """Two slices of the document, about ``first_tokens`` and ``second_tokens`` long in this
    model's tokens, cut at line ends."""
    lines = DOCUMENT.read_text().splitlines(keepends=True)
    parts, count, first = [], 0, None
    for line in lines:
        parts.append(line)
        count += count_tokens(line)
        if first is None and count >= first_tokens:
            first, parts, count = "".join(parts), [], 0
        elif first is not None and count >= second_tokens:
            return first, "".join(parts)
    raise SystemExit(f"{DOCUMENT} is too short for {first_tokens} + {second_tokens} tokens")


def turns(first: str, second: str, answer: str | None) -> list[dict]:
    messages = [{"role": "user", "content": "Here is the first part of a design document.\n\n" + first +
                 "\n\nSummarize it in a few paragraphs."}]
    if answer is not None:
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "Here is the rest of it.\n\n" + second +
                      "\n\nWhat does this part add to the first?"}]
    return messages


def talk(session, first: str, second: str, max_tokens: int) -> list[dict]:
    from localctx.backends.base import GenerationParams

    params = GenerationParams(max_tokens=max_tokens)
    out, answer = [], None
    for _ in range(2):
        before = session.plan.allocated_context
        started = time.perf_counter()
        events = list(session.generate(turns(first, second, answer), params))
        tokens = [e.token for e in events if e.kind == "token"]
        stats = events[-1].stats
        out.append({"tokens": tokens, "prompt_tokens": stats.prompt_tokens, "cached_tokens": stats.cached_tokens,
                    "allocated_before": before, "allocated_after": session.plan.allocated_context,
                    "seconds": round(time.perf_counter() - started, 2)})
        answer = "".join(e.text for e in events if e.kind == "token")
    return out


def sessions(model: str, backend_name: str, context: int | None):
    """(grown, full): the first allocating the chat's first allocation, the second the whole context."""
    from localctx.app.session_options import GROW_FROM_TOKENS, SessionRequest, plan_session

    def one(allocate: int | None):
        req = SessionRequest(model=model, kv="fp16", backend=backend_name, context=context, allocate=allocate,
                             grow_to_context=allocate is not None)
        return plan_session(req).load()

    return one(GROW_FROM_TOKENS), one(None)


def check(model: str, backend_name: str, args) -> dict:
    grown, full = sessions(model, backend_name, args.context)
    try:
        empty = grown.count_tokens([{"role": "user", "content": ""}])
        first, second = conversation_texts(lambda s: grown.count_tokens([{"role": "user", "content": s}]) - empty,
                                           args.first_tokens, args.second_tokens)
        row = {"model": Path(model).name, "backend": backend_name, "context": full.plan.context,
               "full_allocated": full.plan.allocated_context,
               # the document changes as the project does: which text this row read
               "document_lines": (first + second).count("\n"),
               "text_sha256": hashlib.sha256((first + second).encode()).hexdigest()}
        row["grown"] = talk(grown, first, second, args.max_tokens)
        row["full"] = talk(full, first, second, args.max_tokens)
    finally:
        grown.close()
        full.close()
    row["identical"] = [a["tokens"] == b["tokens"] for a, b in zip(row["grown"], row["full"])]
    row["grew"] = row["grown"][1]["allocated_after"] > row["grown"][0]["allocated_before"]
    row["reused"] = row["grown"][1]["cached_tokens"] > 0
    return row


def main(argv: list[str] | None = None) -> int:
    from localctx.backends.models.ref import bundled_default_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", help="GGUF (repeatable; default: the bundled SmolLM2)")
    ap.add_argument("--backend", action="append", choices=["llamacpp", "torch"], help="repeatable (default: llamacpp)")
    ap.add_argument("--context", type=int, default=None, help="the plan's maximum (default: the trained context)")
    ap.add_argument("--first-tokens", type=int, default=2800, help="the first turn's document slice")
    ap.add_argument("--second-tokens", type=int, default=1600, help="the second turn's document slice")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("docs/results/speed/growth-identity.json"))
    args = ap.parse_args(argv)
    rows = []
    for model in args.model or [str(bundled_default_path())]:
        for backend_name in args.backend or ["llamacpp"]:
            row = check(model, backend_name, args)
            print(f"{row['model']} {backend_name}: identical {row['identical']}, allocated "
                  f"{row['grown'][0]['allocated_before']} → {row['grown'][1]['allocated_after']} "
                  f"(full {row['full_allocated']}), second turn {row['grown'][1]['cached_tokens']} of "
                  f"{row['grown'][1]['prompt_tokens']} prompt tokens cached", flush=True)
            rows.append(row)
    result = {"command": "python benchmarks/speed/growth_identity.py " + " ".join(argv or sys.argv[1:]),
              "rows": rows,
              "all_identical": all(all(r["identical"]) and r["grew"] and r["reused"] for r in rows)}
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, args.out)
    return 0 if result["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
