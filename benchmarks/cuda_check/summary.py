"""The text summary of benchmarks/cuda_check/one_run.py's JSON (cuda-check.txt): one block per phase."""
from __future__ import annotations


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _ms(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "-"


def summary_text(data: dict) -> str:
    dev = data.get("device", {})
    lines = [f"cuda_check ({data.get('mode')}) on {dev.get('name')} — torch {dev.get('torch')}, "
             f"CUDA {dev.get('cuda')}, triton {dev.get('triton')}; started {data.get('started')}, "
             f"{data.get('elapsed_s', 0):.0f} s of a {data.get('budget_s'):.0f} s budget"]
    phases = data.get("phases", {})
    for name, p in phases.items():
        lines += ["", f"== {name}: {p.get('status')} ({p.get('seconds', 0):.1f} s)"]
        if p.get("error"):
            lines.append(f"   error: {p['error']}")
        if p.get("reason"):
            lines.append(f"   {p['reason']}")
        lines += globals().get(f"_{name}", lambda _: [])(p)
        for s in p.get("skipped", []) or []:
            lines.append(f"   skipped (time budget): {', '.join(f'{k}={v}' for k, v in s.items() if k != 'reason')}")
    if "imported_packages" in data:
        lines += ["", "third-party packages imported: " + ", ".join(data["imported_packages"])]
    return "\n".join(lines) + "\n"


def _pytest(p: dict) -> list[str]:
    if "counts" not in p:
        return []
    out = [f"   {p['command']} → return code {p['returncode']}; " + ", ".join(f"{v} {k}" for k, v in p["counts"].items())]
    out += [f"   {t['outcome']}: {t['test']} {t['message']}" for t in p.get("tests", []) if t["outcome"] != "passed"]
    return out


def _kernels(p: dict) -> list[str]:
    if "results" not in p:
        return []
    out = [f"   {p['passed']}/{p['cases']} cases within tolerance" + (" (TRITON_INTERPRET)" if p.get("triton_interpret")
                                                                      else " (compiled)")]
    by_kernel: dict[tuple, list] = {}
    for r in p["results"]:
        by_kernel.setdefault((r["kernel"], r["dtype"]), []).append(r)
    for (kernel, dtype), rs in by_kernel.items():
        worst = max(rs, key=lambda r: r["max_abs_err"] / r["tol"] if r["tol"] else (0 if r["max_abs_err"] == 0 else 1e9))
        out.append(f"   {kernel} {dtype}: {sum(r['passed'] for r in rs)}/{len(rs)} pass; worst {worst['case']} "
                   f"err {worst['max_abs_err']:.2e} (tol {worst['tol']:.0e})")
    out += [f"   FAIL {r['kernel']} {r['case']} {r['dtype']}: err {r['max_abs_err']:.3e} > tol {r['tol']:.0e}"
            for r in p["results"] if not r["passed"]]
    out += [f"   ERROR {e['kernel']} {e['case']} {e['dtype']}: {e['error']}" for e in p.get("errors", [])]
    return out


def _bandwidth(p: dict) -> list[str]:
    if "gbs" not in p:
        return []
    return [f"   copy of {_gib(p['bytes'])}: {p['median_ms']:.3f} ms → {p['gbs']:.0f} GB/s (read + write), {p['method']}"]


def _decode_attention(p: dict) -> list[str]:
    if "rows" not in p:
        return []
    out = [f"   shape {p['shape']}; median of {p['reps']} after {p['warmup']} warm-up calls",
           f"   {'context':>7} {'batch':>5} {'variant':>18} {'eager ms':>9} {'graph ms':>9} {'MiB read':>9} "
           f"{'GB/s':>7} {'of copy':>7} {'vs sdpa':>7}"]
    for r in p["rows"]:
        speed = f"{r['speedup_vs_sdpa']:.2f}x" if r["speedup_vs_sdpa"] else "-"
        out.append(f"   {r['context']:>7} {r['batch']:>5} {r['variant']:>18} {_ms(r['eager_ms']):>9} "
                   f"{_ms(r['graph_ms']):>9} {r['bytes_read'] / 2**20:>9.1f} {r['gbs']:>7.1f} "
                   f"{r['copy_fraction']:>7.1%} {speed:>7}")
    notes = sorted({f"{r['variant']}: {r['note']}" for r in p["rows"] if r["note"] and r["variant"].startswith("sdpa")})
    out += [f"   {n}" for n in notes]
    out += [f"   check {c['variant']} @{c['context']} b{c['batch']}: err {c['max_abs_err']:.2e} (tol {c['tol']:.0e}) "
            + ("ok" if c["passed"] else "FAIL") for c in p.get("checks", [])]
    out += [f"   unavailable {u['variant']} @{u['context']} b{u['batch']}: {u['error']}" for u in p.get("unavailable", [])]
    out += [f"   ERROR {e}" for e in p.get("errors", [])]
    g = p.get("goal", {})
    if g.get("speedups"):
        out.append(f"   goal int4 ≥ {g['target']}x sdpa from {g['from_context']}: {'met' if g['met'] else 'NOT met'} ("
                   + ", ".join(f"{s['context']}/b{s['batch']}: {s['speedup']:.2f}x" for s in g["speedups"]) + ")")
    return out


def _end_to_end(p: dict) -> list[str]:
    if "rows" not in p:
        return []
    out = [f"   model {p['model']['n_layers']} layers × {p['model']['hidden_size']}, {p['dtype']}, weights read per "
           f"step {_gib(p['weight_bytes'])}; kernels: {p['kernels']} (LOCALCTX_TRITON={p['dispatch_mode']}); "
           f"built in {p['build_seconds']:.1f} s",
           f"   {'context':>7} {'policy':>20} {'tok/s':>8} {'step ms':>8} {'GiB/step':>8} {'of copy':>7} "
           + " ".join(f"{'plan ' + k:>13} {'ratio':>6}" for k in p["profiles"])]
    for r in p["rows"]:
        plans = " ".join(f"{r['planner_' + k]['tok_s']:>13.1f} {r['planner_' + k]['measured_over_projected']:>6.2f}"
                         for k in p["profiles"])
        out.append(f"   {r['context']:>7} {r['policy']:>20} {r['tok_s']:>8.1f} {r['step_ms']:>8.2f} "
                   f"{r['bytes_per_step'] / 2**30:>8.2f} {r['copy_fraction']:>7.1%} {plans}")
    for k, prof in p["profiles"].items():
        out.append(f"   profile {k}: {prof['name']}, {prof['bandwidth_bytes_s'] / 1e9:.0f} GB/s ({prof['bandwidth_source']})")
    out += [f"   ERROR {e}" for e in p.get("errors", [])]
    g = p.get("goals", {})
    bw, plan = g.get("bandwidth_at_32k", {}), g.get("planner_within_25pct", {})
    if bw.get("rows"):
        out.append(f"   goal ≥ 70% of copy bandwidth at 32K: {'met' if bw['met'] else 'NOT met'} ("
                   + ", ".join(f"{x['policy']} {x['copy_fraction']:.0%}" for x in bw["rows"]) + ")")
    if plan.get("rows"):
        out.append(f"   goal planner (measured profile) within ±25%: {'met' if plan['met'] else 'NOT met'}")
    return out
