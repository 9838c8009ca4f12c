"""Prompt lookup on prompts its policy was not tuned on: `localctx run --speculate ngram` against
`--speculate off`, paired and interleaved (the order alternates), each run a fresh process, greedy.

The draft planner's priors came from ``benchmarks/reuse/reuse_bench.py``'s two prompts (a story; a
copied passage). These are others: free text (an explanation, no passage to copy) and a code edit
(a function given in the prompt, to be returned with one change: copy-heavy). Per pair: both
answers' decode tok/s (each run's own `--json` stats), their ratio, whether the texts are equal,
tokens per step, drafted / accepted tokens, the verify-cost ratio the answer measured, and the
1-minute load average (the host may be shared). Medians over the pairs per prompt.

    python benchmarks/reuse/speculate_heldout.py --pairs 5 --json docs/results/reuse/speculate-heldout.json

``--in-process``: both sides answer in this one process, from one session opened as `localctx run`
opens it (the same plan, sized to the longest request), emptied before every answer so each prefills
its prompt from scratch. A fresh process's decode speed on a shared 2-core host moves by ±15% from
process to process; within one process the pair sees the same process, threads and memory (the host's
noise from answer to answer stays: docs/benchmarks-reuse.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = {
    "free-text": ("Explain how ocean tides work: why most coasts see two high tides a day, what spring and "
                  "neap tides are, and how the shape of a bay changes the range."),
    "code-edit": ("Rename the variable `total` to `running_sum` in this function and return the whole "
                  "function, unchanged otherwise:\n\n```python\n"
                  "def summarize(orders, tax_rate):\n"
                  "    total = 0\n"
                  "    for order in orders:\n"
                  "        if order.cancelled:\n"
                  "            continue\n"
                  "        price = order.quantity * order.unit_price\n"
                  "        if order.discount:\n"
                  "            price -= price * order.discount\n"
                  "        total += price\n"
                  "    taxed = total * (1 + tax_rate)\n"
                  "    return {\"count\": len(orders), \"total\": round(total, 2), \"taxed\": round(taxed, 2)}\n"
                  "```"),
}


def run_once(model: str, prompt: str, speculate: str, max_tokens: int, env: dict, kv: str | None = None) -> dict:
    args = [sys.executable, "-m", "localctx.app.cli", "run", prompt, "-m", model, "--backend", "llamacpp",
            "--max-tokens", str(max_tokens), "--speculate", speculate, "--json", *(["--kv", kv] if kv else [])]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"localctx run --speculate {speculate} failed: {out.stderr.strip()}")
    result = json.loads(out.stdout)
    return answer_row(result["text"], result["stats"])


def answer_row(text: str, s: dict) -> dict:
    """One answer's row from its stats as `run --json` writes them (``GenerationStats.to_dict``)."""
    return {"text": text, "decode_tok_s": s["decode_tok_s"], "generated": s["generated_tokens"],
            "cached": s["cached_tokens"], "tokens_per_step": s["tokens_per_step"], "drafted": s["drafted_tokens"],
            "accepted": s["accepted_tokens"], "verify_cost_ratio": s["verify_cost_ratio"],
            "verify_exact_rows": s["verify_exact_rows"], "speculate": s["speculate"]}


class InProcess:
    """One llama.cpp session that answers both sides of every pair (``--in-process``)."""

    def __init__(self, model: str | None, max_tokens: int, kv: str | None):
        from localctx.app.commands.run import request_tokens
        from localctx.app.session_options import SessionRequest, open_session

        need = max(request_tokens(text, None, max_tokens) for text in PROMPTS.values())
        self.session = open_session(SessionRequest(model=model, backend="llamacpp", kv=kv, allocate=need))

    def run_once(self, prompt: str, speculate: str, max_tokens: int) -> dict:
        from localctx.backends.base import GenerationParams

        self.session.reset()  # every answer prefills its prompt, as a fresh `localctx run` does
        events = list(self.session.generate([{"role": "user", "content": prompt}],
                                            GenerationParams(max_tokens=max_tokens, speculate=speculate)))
        return answer_row("".join(e.text for e in events), events[-1].stats.to_dict())


def write(out: Path, args: argparse.Namespace, rows: dict[str, list[dict]]) -> dict:
    summary = {name: {"pairs": len(p), "median_ratio": round(statistics.median(x["ratio"] for x in p), 3),
                      "all_identical": all(x["identical"] for x in p),
                      "median_tokens_per_step": round(statistics.median(x["ngram"]["tokens_per_step"] for x in p), 3),
                      "median_verify_cost_ratio": round(statistics.median(x["ngram"]["verify_cost_ratio"] for x in p), 3),
                      "median_off_tok_s": round(statistics.median(x["off"]["decode_tok_s"] for x in p), 2),
                      "median_ngram_tok_s": round(statistics.median(x["ngram"]["decode_tok_s"] for x in p), 2)}
               for name, p in rows.items() if p}
    doc = {"command": "python benchmarks/reuse/speculate_heldout.py " + " ".join(sys.argv[1:]),
           "model": Path(args.model).name, "kv": args.kv or "planned", "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
           "sides": "one process, one session" if args.in_process else "a fresh process each",
           "prompts": {name: PROMPTS[name] for name in rows}, "load_average_at_end": os.getloadavg(),
           "summary": summary, "pairs": rows}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)
    return summary


def main() -> int:
    from localctx.backends.models.ref import bundled_default_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=str(bundled_default_path()))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--kv", default=None, help="the KV policy of both sides (default: planned)")
    ap.add_argument("--json", default="docs/results/reuse/speculate-heldout.json", metavar="PATH")
    ap.add_argument("--in-process", action="store_true", help="both sides in this process, one session (see above)")
    args = ap.parse_args()
    env = dict(os.environ)
    here = InProcess(args.model, args.max_tokens, args.kv) if args.in_process else None
    rows: dict[str, list[dict]] = {name: [] for name in args.prompts.split(",")}
    out = Path(args.json)
    summary: dict = {}
    for i in range(args.pairs):
        for name, pairs in rows.items():  # prompts interleaved too: a load spike hits both tasks
            order = ("off", "ngram") if i % 2 == 0 else ("ngram", "off")  # alternates: neither side always first
            pair: dict = {"order": list(order), "started": time.strftime("%H:%M:%S"),
                          "load_average": round(os.getloadavg()[0], 2)}
            for side in order:
                pair[side] = (here.run_once(PROMPTS[name], side, args.max_tokens) if here else
                              run_once(args.model, PROMPTS[name], side, args.max_tokens, env, args.kv))
            pair["ratio"] = round(pair["ngram"]["decode_tok_s"] / pair["off"]["decode_tok_s"], 3)
            pair["identical"] = pair["ngram"]["text"] == pair["off"]["text"]
            for side in order:
                pair[side].pop("text")
            pairs.append(pair)
            print(name, json.dumps(pair), file=sys.stderr)
            summary = write(out, args, rows)  # after every pair: a run cut short keeps its pairs
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
