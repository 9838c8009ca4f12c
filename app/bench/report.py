"""The stdout tables of a bench result (rich): one row per series × context, the headline ratios,
and the goals."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from localctx.app.bench.settings import context_label
from localctx.kvcache.cost import format_bytes


def tok_s(stat: dict | None) -> str:
    return "" if not stat else f"{stat['median']:.1f} ±{stat['spread_pct']:.0f}%"


def ratio(x: float | None, suffix: str = "×") -> str:
    return "" if x is None else f"{x:.2f}{suffix}"


def pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def point_cells(p: dict) -> list[str]:
    """The row cells after series and context; 'n/a' / 'error' rows say why in the first cell."""
    if p["status"] != "ok":
        return [p["status"]] + [""] * (len(HEADERS) - 3)  # the reasons are listed under the table
    return [tok_s(p["prefill_tok_s"]), tok_s(p["decode_tok_s"]), ratio(p["decode_vs_baseline"]),
            format_bytes(p["kv_bytes"]), format_bytes(p["kv_bytes_projected"]), format_bytes(p["peak_rss_bytes"]),
            f"{p['roofline_decode_tok_s']:.0f}", pct(p["roofline_fraction"]), f"{p['planner_decode_tok_s']:.0f}"]


HEADERS = ["series", "context", "prefill tok/s", "decode tok/s", "decode vs llama.cpp", "KV held",
           "KV (cost model)", "peak RSS", "roofline tok/s", "of roofline", "planner tok/s"]


def measurements_table(result: dict) -> Table:
    runs = result["settings"]["runs"]
    table = Table(title=f"localctx bench — {result['model']['name']} (median ±half-range of {runs} run{'s' if runs != 1 else ''})")
    for h in HEADERS:
        table.add_column(h, justify="left" if h == "series" else "right")
    for entry in result["series"]:
        if entry["status"] != "ok":
            table.add_row(entry["label"], "", "refused")
            continue
        for p in entry["points"]:
            table.add_row(entry["label"], context_label(p["context"]), *point_cells(p))
        table.add_section()
    return table


def headline_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    head = result["headline"]
    labels = {e["key"]: e["label"] for e in result["series"]}
    cols = ["series", f"decode {context_label(head['long'])} ÷ decode {context_label(head['short'])}",
            "÷ llama.cpp's ratio"]
    if head.get("far"):
        cols.append(f"decode {context_label(head['far'])} ÷ decode {context_label(head['short'])}")
    rows = []
    for r in head["rows"]:
        row = [labels[r["series"]], ratio(r["ratio"], ""), ratio(r.get("vs_baseline_ratio"))]
        if head.get("far"):
            row.append(ratio(r.get("ratio_far"), "") or "n/a")
        rows.append(row)
    return cols, rows


def footnotes(result: dict) -> list[str]:
    """One line per distinct reason a point is n/a or failed, and per refused series."""
    notes: dict[str, None] = {}
    for entry in result["series"]:
        if entry["status"] != "ok":
            notes[f"refused ({entry['label']}): {entry['reason']}"] = None
        bases = {p["planner_basis"] for p in entry["points"] if p["status"] == "ok"}
        if bases:
            notes[f"planner tok/s for {entry['label']}: " + "; ".join(sorted(bases))] = None
        for p in entry["points"]:
            if p["status"] != "ok":
                notes[f"{p['status']} ({entry['label']} at {context_label(p['context'])}): {p['reason']}"
                      if p["status"] == "error" else f"n/a: {p['reason']}"] = None
    return list(notes)


def print_report(result: dict, console: Console) -> None:
    console.print(measurements_table(result))
    if result["settings"].get("stopped"):
        console.print(escape(result["settings"]["stopped"]))
    for note in footnotes(result):
        console.print(escape(note))
    bw = result["projection"]["bandwidth"]
    console.print(f"roofline: {result['projection']['formula']}, bandwidth {bw['bytes_s'] / 1e9:.1f} GB/s "
                  f"({bw['source']}); planner tok/s: {result['projection']['planner']}, planning for "
                  f"{bw['planner_hardware']}; baseline: plain llama-cpp-python, default settings, "
                  f"n_threads={result['settings']['threads']} as localctx uses, measured interleaved in this run")
    if result["headline"]:
        cols, rows = headline_rows(result)
        table = Table(title="headline: how decode speed holds up as the context grows")
        for c in cols:
            table.add_column(c, justify="left" if c == "series" else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for g in result["goals"]:
        console.print(escape(f"goal [{g['status']}] {g['goal']}: {g['detail']}"))
