"""The planner's decision table for docs/planner.md: named machines × known models × contexts.

    python benchmarks/planner/planner_table.py --json docs/results/planner/planner-table.json > /tmp/table.md

Each row is what `localctx plan -m MODEL --hardware H --context N` decides, with the backend that
machine would run (Apple → mlx, NVIDIA → torch, CPU → llama.cpp) and that backend's capabilities in
this build."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from localctx.backends.machine.planner_inputs import decision_rows
from localctx.kvcache.cost import format_bytes


def short_reason(row) -> str:
    if row.plan is None:
        if not row.rejected:  # the weights alone do not fit
            return "weights " + row.refusal.split(": weights ", 1)[-1].split(";")[0]
        seen = []
        for r in row.rejected:  # the distinct reasons, most exact candidate first
            text = r.reason.split(";")[0]
            if text not in seen:
                seen.append(text)
        return "; ".join(f"{text}" for text in seen[:3])
    why = next(r for r in row.plan.reasons if r.startswith(("exact", "lossy", "8-bit", "4-bit")))
    return why.replace("lossy: ", "").replace("exact: ", "")


def raw(row) -> dict:
    """One row as data: the inputs, the budget, and the plan (or the refusal and each candidate's reason)."""
    out = {"hardware": row.profile, "hardware_described": row.hardware.describe(), "model": row.spec.name,
           "context": row.context, "kv_budget_bytes": row.budget_kv, "why": short_reason(row)}
    if row.plan is None:
        return {**out, "plan": None, "refusal": row.refusal,
                "rejected": [{"policy": str(r.policy), "reason": r.reason} for r in row.rejected]}
    return {**out, "plan": row.plan.to_dict()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, metavar="FILE", help="also write every row as data here")
    args = ap.parse_args(argv)
    rows = decision_rows()
    if args.json:
        command = "python benchmarks/planner/planner_table.py " + " ".join(argv or sys.argv[1:])
        Path(args.json).write_text(json.dumps({"command": command, "rows": [raw(r) for r in rows]}, indent=1) + "\n")
    print("| hardware | model | context | backend | policy | KV peak / KV budget | decode tok/s | why |")
    print("|---|---|---:|---|---|---|---:|---|")
    for r in rows:
        budget = format_bytes(max(r.budget_kv, 0))
        if r.plan is None:
            print(f"| {r.profile} | {r.spec.name} | {r.context:,} | | **refused** | — / {budget} | | "
                  f"{short_reason(r)} |")
            continue
        p = r.plan
        print(f"| {r.profile} | {r.spec.name} | {r.context:,} | {p.backend} | `{p.policy}` "
              f"({'exact' if p.exact else 'lossy'}) | {format_bytes(p.kv_bytes)} / {budget} | "
              f"{p.decode_tok_s:.1f} | {short_reason(r)} |")


if __name__ == "__main__":
    main()
