"""Time to a first answer: `localctx run --max-tokens 2 hi` against plain llama-cpp-python loading the
same GGUF and answering the same chat message (same n_ctx, threads, KV types and flash-attention
setting as localctx's plan), each a fresh process, timed wall-clock from start to exit, paired and
interleaved (the order alternates pair by pair) after warm-up runs, for the bundled SmolLM2 and for a
151,936-token-vocabulary GGUF made from it (benchmarks/tools/make_big_vocab_gguf.py). Writes JSON with
every time, the ratio of each pair and the medians.

    python benchmarks/speed/startup.py --pairs 7 --out docs/results/run-chat/benchmarks-startup.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BASELINE = """
import sys
from llama_cpp import Llama
path, n_ctx, threads, type_k, type_v, flash, prompt = sys.argv[1:8]
llm = Llama(model_path=path, n_ctx=int(n_ctx), n_threads=int(threads), n_threads_batch=int(threads), n_batch=512,
            type_k=int(type_k), type_v=int(type_v), flash_attn=flash == "1", verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=2, temperature=0.0)
print(out["choices"][0]["message"]["content"])
"""


def localctx_command() -> list[str]:
    exe = Path(sys.executable).with_name("localctx")
    return [str(exe)] if exe.exists() else [shutil.which("localctx") or "localctx"]


def load_settings(path: Path) -> dict:
    """What `localctx run -m PATH` gives llama.cpp: its plan's n_ctx, KV types, flash attention, threads."""
    from localctx.app.session_options import SessionRequest, make_plan, resolve_model
    from localctx.backends.llamacpp import shift
    from localctx.backends.llamacpp.session import default_threads

    req = SessionRequest(model=str(path))
    _ref, spec = resolve_model(req)
    plan = make_plan(req, spec)
    if plan.backend != "llamacpp":
        raise SystemExit(f"this benchmark compares the llama.cpp backend; the plan here chose {plan.backend}")
    settings = shift.settings_for(plan, shift.local_calibration())
    type_k, type_v = settings.type_ids()
    return {"n_ctx": settings.n_ctx, "threads": default_threads(), "type_k": type_k, "type_v": type_v,
            "flash_attn": bool(settings.flash_attn), "policy": str(plan.policy), "vocab": spec.vocab_size}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds user + system, stdout) of one fresh process."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}... exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return wall, cpu, proc.stdout.strip()


def measure(path: Path, pairs: int, warmup: int, prompt: str) -> dict:
    s = load_settings(path)
    ours = localctx_command() + ["run", "-m", str(path), "--max-tokens", "2", prompt]
    plain = [sys.executable, "-c", BASELINE, str(path), str(s["n_ctx"]), str(s["threads"]), str(s["type_k"]),
             str(s["type_v"]), "1" if s["flash_attn"] else "0", prompt]
    for _ in range(warmup):  # fills the page cache, localctx's header cache and Python's bytecode caches
        timed(ours)
        timed(plain)
    rows = []
    for i in range(pairs):
        order = ("localctx", "llamacpp") if i % 2 == 0 else ("llamacpp", "localctx")
        got = {name: timed(ours if name == "localctx" else plain) for name in order}
        rows.append({"first": order[0], "localctx_s": round(got["localctx"][0], 4),
                     "llamacpp_s": round(got["llamacpp"][0], 4),
                     "ratio": round(got["localctx"][0] / got["llamacpp"][0], 4),
                     "localctx_cpu_s": round(got["localctx"][1], 4), "llamacpp_cpu_s": round(got["llamacpp"][1], 4),
                     "cpu_ratio": round(got["localctx"][1] / got["llamacpp"][1], 4),
                     "localctx_text": got["localctx"][2], "llamacpp_text": got["llamacpp"][2]})
    ratios = [r["ratio"] for r in rows]
    return {"model": path.name, "vocab": s["vocab"], "settings": s, "pairs": rows,
            "median_localctx_s": round(statistics.median(r["localctx_s"] for r in rows), 4),
            "median_llamacpp_s": round(statistics.median(r["llamacpp_s"] for r in rows), 4),
            "median_ratio": round(statistics.median(ratios), 4), "max_ratio": max(ratios),
            "median_cpu_ratio": round(statistics.median(r["cpu_ratio"] for r in rows), 4),
            "header_parse_uncached_ms": round(header_parse_ms(path), 2)}


def header_parse_ms(path: Path, repeats: int = 3) -> float:
    """The first-run cost the cache saves: one parse of the header, best of ``repeats``."""
    from localctx.backends.models.gguf_header import read_header

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        read_header(path)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompt", default="hi")
    ap.add_argument("--model", type=Path, action="append", default=None,
                    help="GGUF to time (repeatable; default: SmolLM2 and its 151,936-token copy)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/run-chat/benchmarks-startup.json"))
    args = ap.parse_args(argv)
    if args.pairs < 5:
        raise SystemExit("--pairs must be at least 5")
    models = args.model
    if not models:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
        import make_big_vocab_gguf as big

        from localctx.backends.models.ref import bundled_default_path

        out = big.default_out(big.QWEN2_VOCAB)
        if not out.exists():
            big.main(["--out", str(out)])
        models = [bundled_default_path(), out]
    from localctx.backends.machine.detect import cpu_name

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results = [measure(Path(m), args.pairs, args.warmup, args.prompt) for m in models]
    report = {"command": "python benchmarks/speed/startup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "host": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                       "loadavg_before": [round(x, 2) for x in load_before],
                       "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
              "prompt": args.prompt, "max_tokens": 2, "warmup": args.warmup, "models": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)
    for r in results:
        print(f"{r['model']} (vocab {r['vocab']:,}, n_ctx {r['settings']['n_ctx']}): localctx "
              f"{r['median_localctx_s']:.3f} s, llama-cpp-python {r['median_llamacpp_s']:.3f} s, "
              f"median ratio {r['median_ratio']:.2f} (max {r['max_ratio']:.2f}), CPU-time ratio "
              f"{r['median_cpu_ratio']:.2f}, over {len(r['pairs'])} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
