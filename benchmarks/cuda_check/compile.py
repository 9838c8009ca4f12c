"""Compile every CUDA kernel specialization the backend can launch, ahead of time and without a GPU,
and report each one's resource use: registers per thread, spill stores/loads, shared memory, local
memory, warps, and the occupancy that follows on each architecture (docs/benchmarks-cuda.md).

    python benchmarks/cuda_check/compile.py --arch sm_89 --json docs/results/cuda/compile-sm89.json \\
        --table kernels_cuda/resource_table.json

Specializations come from ``specializations.py`` (the wrappers' own launches, recorded); each is
compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 89 or 90, 32))`` in a fresh
Triton cache, and read back with ``resources.py``. Exit status 1 when any specialization fails to
compile, spills, uses local memory, or needs more shared memory than the architecture gives a
block; 2 for bad arguments. (A 32-byte stack frame without spills is the range reduction of
``tl.cos``/``tl.sin`` for large angles, which keeps a small array on the stack: reported, not failed.)
``--table`` merges the compiled rows into the launcher's table (``merge_table``: per key, the fewest
warps that compiled without a spill), so the architectures may be compiled by separate commands,
and ``--only-failed JSON`` recompiles what spilled with twice the warps; ``--from-json``
rebuilds the table from JSON files without compiling. ``--subset ci`` compiles the few of ``specializations.subset_ci``."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_89,sm_90", help="comma-separated: sm_89 (RTX 4090), sm_90 (H100)")
    p.add_argument("--json", type=Path, default=None, help="where the per-specialization JSON goes")
    p.add_argument("--table", type=Path, default=None,
                   help="also write the launcher's resource table (kernels_cuda/resource_table.json)")
    p.add_argument("--subset", choices=("all", "ci"), default="all")
    p.add_argument("--block-n", type=int, default=None,
                   help="compile this key tile at every head dim instead of the launcher's choices (to see why "
                        "it is not one)")
    p.add_argument("--num-warps", type=int, default=None,
                   help="compile every specialization with this many warps instead of the launcher's (to see why "
                        "it does not use them)")
    p.add_argument("--only-failed", type=Path, default=None,
                   help="a compile.py JSON: recompile its failed specializations with twice their warps (the retry "
                        "whose spill-free rows replace the spilling ones in the table)")
    p.add_argument("--from-json", type=Path, nargs="+", default=None,
                   help="compile nothing: rebuild --table from these compile.py JSON files")
    p.add_argument("--only", default=None, help="a regular expression: compile only the cases whose label matches")
    p.add_argument("--resume", action="store_true",
                   help="keep the results an unfinished --json already holds and compile only the rest")
    p.add_argument("--jobs", type=int, default=1, help="compile processes (each compile is single-threaded)")
    return p.parse_args(argv)


def _compile_one(job: tuple) -> dict:
    """Worker: compile one specialization for one architecture and read its resources back."""
    module_name, kernel_name, signature, constexprs, attrs, options, arch_name = job
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import resources
    from localctx.kernels_cuda import occupancy

    limits = occupancy.arch(arch_name)
    kernel = getattr(importlib.import_module(module_name), kernel_name)
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG: Triton prints its own ptxas -v log
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", limits.capability, 32), options=dict(options))
    except Exception as exc:  # a compile error is a result, reported and failed on
        return {"ok": False, "problems": [f"compile error: {type(exc).__name__}: {str(exc)[-1500:]}"],
                "compile_s": round(time.perf_counter() - t0, 2)}
    compile_s = time.perf_counter() - t0
    tools = resources.Tools.from_triton()
    md = compiled.metadata
    try:  # the log of the ptxas run that made this cubin; else run ptxas -v again with Triton's flags
        ptx = resources.parse_ptxas(log.getvalue(), md.name)
    except ValueError:
        ptx = resources.ptxas_info(tools, compiled.asm["ptx"], limits.name, md.name, md.enable_fp_fusion)
    cubin = resources.cubin_info(tools, compiled.asm["cubin"], md.name)
    shared = md.shared + cubin.shared
    occ = occupancy.occupancy(limits, cubin.registers, shared, md.num_warps)
    problems = []
    if ptx.spill_stores or ptx.spill_loads:
        problems.append(f"spills: {ptx.spill_stores} B stored, {ptx.spill_loads} B loaded")
    if cubin.local:
        problems.append(f"local memory {cubin.local} B")
    if shared > limits.smem_per_block:
        problems.append(f"shared memory {shared} B over the {limits.smem_per_block} B a block may use")
    if ptx.registers != cubin.registers:
        problems.append(f"ptxas -v says {ptx.registers} registers, the cubin {cubin.registers}")
    return {"ok": not problems, "problems": problems, "registers": cubin.registers,
            "spill_stores": ptx.spill_stores, "spill_loads": ptx.spill_loads, "stack": cubin.stack,
            "local": cubin.local, "shared": shared, "shared_dynamic": md.shared, "shared_static": cubin.shared,
            "warps": md.num_warps, "stages": md.num_stages, "blocks_per_sm": occ.blocks_per_sm,
            "warps_per_sm": occ.warps_per_sm, "occupancy": round(occ.fraction, 4), "limiter": occ.limiter,
            "cubin_bytes": len(compiled.asm["cubin"]), "compile_s": round(compile_s, 2)}


def _load() -> str:
    try:
        return open("/proc/loadavg").read().split()[:3]
    except OSError:
        return "unknown"


def table_rows(specs: list[dict], archs: list[str]) -> dict:
    """The launcher's rows from compiled specializations: partial_kernel's under its table key and
    mass_kernel's under ``launch.MASS`` + key, per arch, each as a list of candidate rows."""
    from localctx.kernels_cuda import launch

    out = {a: {} for a in archs}
    for spec in specs:
        if spec["kernel"] not in ("partial_kernel", "mass_kernel"):
            continue
        c = spec["constexprs"]
        key = launch.table_key(c["HEAD_DIM"], spec["dtype"],
                               launch.segment_name(c["BITS"] if c["HAS_QUANT"] else None, c["GROUP"], c["ROPE"]),
                               c["BLOCK_N"])
        key = key if spec["kernel"] == "partial_kernel" else launch.MASS + key
        for a in archs:
            r = spec["results"].get(a, {})
            if r.get("registers"):
                out[a].setdefault(key, []).append({"registers": r["registers"], "shared": r["shared"],
                                                   "warps": r["warps"],
                                                   "spills": r["spill_stores"] + r["spill_loads"]})
    return out


def merge_table(old: dict, new: dict) -> dict:
    """Per arch and key, the row the launcher uses: among the candidates (old rows and new), those
    with the fewest warps that compiled without a spill (else those with the warps that spilled the
    fewest bytes), folded into one row by the maximum of each figure (two specializations can share
    a key, e.g. the paged and the policy full-precision kernels, which differ only in stride
    divisibility)."""
    merged = {}
    for arch in sorted(set(old) | set(new)):
        keys = set(old.get(arch, {})) | set(new.get(arch, {}))
        merged[arch] = {}
        for key in sorted(keys):
            rows = [old[arch][key]] if key in old.get(arch, {}) else []
            rows += new.get(arch, {}).get(key, [])
            clean = [r for r in rows if not r["spills"]]
            pool = clean or rows
            warps = (min(r["warps"] for r in pool) if clean
                     else min(pool, key=lambda r: (r["spills"], r["warps"]))["warps"])
            same = [r for r in pool if r["warps"] == warps]
            merged[arch][key] = {k: max(r[k] for r in same) for k in ("registers", "shared", "warps", "spills")}
    return merged


def write_table(path: Path, new_rows: dict, sources: list[str], triton_version: str, fresh: bool = False) -> None:
    old = json.loads(path.read_text()) if path.exists() and not fresh else {"archs": {}}
    table = {"sources": list(dict.fromkeys(list(old.get("sources", [])) + sources)), "triton": triton_version,
             "archs": merge_table(old["archs"], new_rows)}
    path.write_text(json.dumps(table, indent=1) + "\n")


def failed_in(path: Path) -> tuple[set[str], dict[tuple, int]]:
    """The case labels of every specialization that failed in a compile.py JSON, and per failed
    (kernel, dtype, constexprs) the warps it had (a retry compiles those kernels only, not the merge
    their cases also launch, with twice the warps)."""
    data = json.loads(path.read_text())
    bad = [s for s in data["specializations"] if not all(r["ok"] for r in s["results"].values())]
    return ({label for s in bad for label in s["cases"]},
            {(s["kernel"], s["dtype"], json.dumps(s["constexprs"], sort_keys=True)):
             max(r.get("warps", s["options"].get("num_warps", 4)) for r in s["results"].values()) for s in bad})


def _identity(spec) -> tuple:
    dtype = next(spec.signature[p] for p in ("q_ptr", "x_ptr", "out_ptr") if p in spec.signature).lstrip("*")
    return spec.name, dtype, json.dumps(spec.constexpr_values(), sort_keys=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/cuda_check/compile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.from_json:
        if args.table is None:
            print("compile.py: --from-json rebuilds --table; name it", file=sys.stderr)
            return 2
        rows, version = {}, None
        for path in args.from_json:
            data = json.loads(path.read_text())
            version = data["triton"]
            for arch, by_key in table_rows(data["specializations"], list(data["archs"])).items():
                for key, cands in by_key.items():
                    rows.setdefault(arch, {}).setdefault(key, []).extend(cands)
        write_table(args.table, rows, [command], version, fresh=True)
        print(f"{args.table}: " + ", ".join(f"{a}: {len(k)} rows" for a, k in rows.items()))
        return 0
    if args.json is None:
        print("compile.py: --json is required (where the results go)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET"):
        print("compile.py: TRITON_INTERPRET is set; unset it (the interpreter builds no machine code)", file=sys.stderr)
        return 2
    cache = tempfile.mkdtemp(prefix="cuda-compile-cache-")
    os.environ["TRITON_CACHE_DIR"] = cache  # every specialization really compiles, and nothing stale is read
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # spills from the ptxas run that made the cubin
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said out loud
    sys.path.insert(0, str(HERE))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    import resources
    import specializations as S
    from localctx.kernels_cuda import occupancy

    try:
        archs = [occupancy.arch(a).name for a in args.arch.split(",") if a.strip()]
    except ValueError as exc:
        print(f"compile.py: {exc}", file=sys.stderr)
        return 2
    backend = CUDABackend(GPUTarget("cuda", occupancy.ARCHS[archs[0]].capability, 32))
    cases = S.subset_ci() if args.subset == "ci" else S.cases(block_n=args.block_n)
    if args.only:
        cases = [c for c in cases if re.search(args.only, c.label)]
    if args.only_failed:
        labels, wanted = failed_in(args.only_failed)
        cases = [c for c in cases if c.label in labels]
    # the launcher's table first (partial_kernel), the heavy-hitter mass kernel last
    order = ("partial_kernel", "merge_kernel", "quant_keys_kernel", "quant_values_kernel", "mass_kernel")
    specs = sorted(S.specializations(cases, backend), key=lambda s: order.index(s.name))
    if args.only_failed:
        specs = [s for s in specs if _identity(s) in wanted]
        for s in specs:
            s.options["num_warps"] = 2 * wanted[_identity(s)]
    if args.num_warps:
        for s in specs:
            s.options["num_warps"] = args.num_warps
    jobs = [(s.kernel.fn.__module__, s.name, s.signature, s.constexprs, s.attrs, s.options, a) for s in specs for a in archs]
    done = {}  # (identity, options, arch) → result kept from an unfinished run (--resume)
    if args.resume and args.json.exists():
        for row in json.loads(args.json.read_text())["specializations"]:
            ident = (row["kernel"], row["dtype"], json.dumps(row["constexprs"], sort_keys=True),
                     json.dumps(row["options"], sort_keys=True))
            for a, r in row["results"].items():
                done[ident + (a,)] = r
    job_keys = [_identity(s) + (json.dumps(s.options, sort_keys=True), a) for s in specs for a in archs]
    t0 = time.perf_counter()
    base = {"command": command,
            "note": "compiled, not run: no GPU executed these kernels; occupancy is arithmetic from the limits below",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host_cpus": os.cpu_count(), "jobs": args.jobs,
            "triton": triton.__version__,
            "tools": resources.Tools.from_triton().versions([occupancy.ARCHS[a].capability for a in archs]),
            "subset": args.subset, "archs": {a: vars(occupancy.ARCHS[a]) for a in archs}, "n_cases": len(cases),
            "n_specializations": len(specs)}
    results = []

    def write(done: bool) -> dict:
        """The JSON so far (rewritten after every compile, so a run cut short keeps what it had)."""
        rows = []
        for i, s in enumerate(specs[:len(results) // len(archs)]):
            rows.append({"kernel": s.name,
                         "dtype": next(s.signature[p] for p in ("q_ptr", "x_ptr", "out_ptr") if p in s.signature).lstrip("*"),
                         "constexprs": s.constexpr_values(), "options": s.options, "pointers": s.pointer_types(),
                         "divisible_by_16": s.divisible(), "cases": s.cases,
                         "results": {a: results[i * len(archs) + j] for j, a in enumerate(archs)}})
        failed = [(r["kernel"], a, r["results"][a]["problems"]) for r in rows for a in archs if not r["results"][a]["ok"]]
        summary = {a: {"compiled": sum(1 for r in rows if "registers" in r["results"][a]),
                       "failed": sum(1 for r in rows if not r["results"][a]["ok"]),
                       "spilling": sum(1 for r in rows if r["results"][a].get("spill_stores", 0)
                                       + r["results"][a].get("spill_loads", 0)),
                       "max_registers": max((r["results"][a].get("registers", 0) for r in rows), default=0),
                       "max_shared": max((r["results"][a].get("shared", 0) for r in rows), default=0)} for a in archs}
        data = base | {"complete": done, "wall_s": round(time.perf_counter() - t0, 1),
                       "host_load_1_5_15": _load(), "summary": summary, "failed": failed, "specializations": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, args.json)
        return data

    def run_one(i: int) -> dict:
        return done[job_keys[i]] if job_keys[i] in done else _compile_one(jobs[i])

    todo = [i for i in range(len(jobs)) if job_keys[i] not in done]
    try:
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                fresh = pool.map(_compile_one, [jobs[i] for i in todo])
                for i in range(len(jobs)):
                    results.append(done[job_keys[i]] if job_keys[i] in done else next(fresh))
                    write(False)
        else:
            for i in range(len(jobs)):
                results.append(run_one(i))
                write(False)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    data = write(True)
    rows, summary, failed, wall = data["specializations"], data["summary"], data["failed"], data["wall_s"]
    if args.table is not None:
        write_table(args.table, table_rows(rows, archs), [command], triton.__version__)
    for a in archs:
        print(f"{a}: {summary[a]}")
    for kernel, a, problems in failed:
        print(f"FAILED {kernel} {a}: {'; '.join(problems)}", file=sys.stderr)
    print(f"{len(specs)} specializations from {len(cases)} cases, {len(jobs)} compiles in {wall:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
