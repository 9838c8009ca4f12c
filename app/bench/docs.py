"""docs/benchmarks-bench.md from a bench result: the machine, the command, the headline ratios, the
goals, the plots and every measurement. Beside the page, the plots are copied to ``img/`` and the run's
JSON to ``results/bench/bench.json`` (where docs/ keeps every raw result), so the page can be
regenerated from the committed JSON without measuring again."""
from __future__ import annotations

import shutil
from pathlib import Path

from localctx.app.bench.report import HEADERS, footnotes, headline_rows, point_cells
from localctx.app.bench.settings import context_label
from localctx.kvcache.cost import format_bytes

SAVED_JSON = Path("results") / "bench" / "bench.json"  # relative to the page's folder
IMAGES = "img"  # relative to the page's folder


def _table(cols: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return out


def shared_note(machine: dict) -> str:
    start, end = machine.get("load_average_start"), machine.get("load_average_end")
    cores = machine.get("logical_cores") or 1
    loads = [x[0] for x in (start, end) if x]
    text = (f"Load average (1 min) {start[0] if start else '?'} at the start and {end[0] if end else '?'} at the "
            f"end, on {cores} logical cores.")
    if loads and max(loads) > cores:
        text += (" **The machine was shared with other work during this run**, so absolute tok/s are low and noisy;"
                 " the ratios (each series against llama.cpp measured in the same run, interleaved run by run) "
                 "are what to compare.")
    return text


def machine_lines(result: dict) -> list[str]:
    m = result["machine"]
    lines = [f"- CPU: {m['cpu']} ({m['machine']}), {m['logical_cores']} logical / {m['physical_cores']} physical cores",
             f"- Memory: {format_bytes(m['memory_bytes'])}; OS: {m['system']}; Python {m['python']}; "
             f"llama-cpp-python {result['baseline'].get('llama_cpp_version') or 'n/a'}",
             f"- Memory bandwidth for the roofline: {result['projection']['bandwidth']['bytes_s'] / 1e9:.1f} GB/s "
             f"({result['projection']['bandwidth']['source']})",
             f"- What the planner knows of this machine: {result['projection']['bandwidth']['planner_hardware']}",
             f"- {shared_note(m)}"]
    return lines


def measurement_rows(result: dict) -> list[list[str]]:
    rows = []
    for entry in result["series"]:
        if entry["status"] != "ok":
            rows.append([entry["label"], "", "refused"] + [""] * (len(HEADERS) - 3))
            continue
        rows += [[entry["label"], context_label(p["context"]), *point_cells(p)] for p in entry["points"]]
    return rows


def render(result: dict, doc_path: Path) -> str:
    s = result["settings"]
    img = IMAGES
    regenerate = (f"localctx bench --from-json {(doc_path.parent / SAVED_JSON).as_posix()} --out /tmp/bench-redraw "
                  f"--doc {doc_path.as_posix()}")
    lines = ["# Benchmarks: speed and memory against context (`localctx bench`)", "",
             f"Measured {result['started']} ({result['duration_s']:.0f} s) with the model {result['model']['name']} "
             f"(`{Path(result['model']['path']).name}`). Figures are medians of {s['runs']} run{'s' if s['runs'] != 1 else ''}, "
             f"each decoding {s['gen_tokens']} tokens after a prompt that fills the context"
             + (f" ({s['stopped']})." if s.get("stopped") else "."), "",
             *([f"> {result['note']}", ""] if result.get("note") else []),
             "## Machine", "", *machine_lines(result), "",
             "## Command", "", "```", result["command"], "```", "",
             f"This page is regenerated from the saved run without measuring: `{regenerate}`.", ""]
    if result["headline"]:
        cols, rows = headline_rows(result)
        lines += ["## Headline: does decode speed hold up as the context grows?", "",
                  "Decode tok/s at the long context divided by decode tok/s at the short one "
                  "(1.0 = no slowdown). Plain llama.cpp is measured in the same run.", "",
                  *_table(cols, rows), ""]
    lines += ["## Goals", ""]
    lines += [f"- **{g['status']}**: {g['goal']} — {g['detail']}" for g in result["goals"]]
    lines += ["", "## Plots", ""] + [f"![{p}]({img}/{p})" for p in result["plots"]] + [""]
    lines += ["## All measurements", "", *_table(HEADERS, measurement_rows(result)), ""]
    lines += [f"- {note}" for note in footnotes(result)] + [""]
    lines += ["## How it is measured", "",
              "- Each measurement runs in a worker subprocess (one per series): load the model with the KV policy, "
              "prefill a prompt of (context − generated) tokens cut from Python's own documentation text, "
              "decode greedily, read the tok/s and KV bytes the session reports; peak RSS is that "
              "measurement's own (the process high-water mark is reset before it on Linux).",
              "- Baseline: plain llama-cpp-python with default settings (f16 KV, flash attention off, default "
              f"batch sizes); only n_ctx (the context) and n_threads={s['threads']} (what localctx's llama.cpp "
              "backend uses, so the comparison is fair) are set. It is measured at every context of every run, "
              "back to back with the other series in a rotating order, so machine drift affects all alike; "
              "'decode vs llama.cpp' is the median of the run-by-run ratios.",
              f"- Roofline: {result['projection']['formula']}; 'of roofline' is measured decode ÷ that bound. "
              f"'planner tok/s' is {result['projection']['planner']}, at the same context.",
              "- 'KV held' is what the cache reports; 'KV (cost model)' is localctx's cost model for the same "
              "policy and tokens (llama.cpp's q8_0/q4_0 carry one scale per 32 values, the cost model's groups a "
              "scale and a min, so those two differ slightly on the llama.cpp backend).",
              "- Contexts past the model's trained length are measured only for windowed policies; others say n/a.",
              ""]
    return "\n".join(lines)


def write_doc(result: dict, out: Path, doc_path: Path, saved_json: Path) -> Path:
    img = doc_path.parent / IMAGES
    img.mkdir(parents=True, exist_ok=True)
    for name in result["plots"]:
        shutil.copyfile(out / name, img / name)
    kept = doc_path.parent / SAVED_JSON
    if saved_json.resolve() != kept.resolve():
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(saved_json, kept)
    doc_path.write_text(render(result, doc_path))
    return doc_path
