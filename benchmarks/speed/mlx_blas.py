"""MLX on a Linux CPU with the BLAS its wheel bundles (netlib's reference BLAS) against a system OpenBLAS
(backends/mlx/blas.py), paired and interleaved: MLX's float32 matrix product (a 256-row batch through a
576x1536 layer, SmolLM2-135M's MLP shape) in GFLOP/s, and `localctx run --backend mlx --json` on the
bundled model (prefill and decode tok/s, greedy, prompt lookup off, its own stats) with
LOCALCTX_MLX_BLAS=bundled and with the default. Each measurement is a fresh process (a process loads
one BLAS). Prints one JSON object.

    python benchmarks/speed/mlx_blas.py [--pairs 3] [--max-tokens 32] [--prompt-repeats 15]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

SGEMM = """
import json, time
import localctx.backends.mlx
from localctx.backends.mlx.blas import use_system_openblas
import mlx.core as mx
a, w = mx.random.normal((256, 576)), mx.random.normal((1536, 576))
mx.eval(a @ w.T)
start = time.perf_counter()
for _ in range(5):
    mx.eval(a @ w.T)
print(json.dumps({"blas": use_system_openblas().library or "bundled",
                  "gflops": 2 * 256 * 576 * 1536 * 5 / (time.perf_counter() - start) / 1e9}))
"""
SETTINGS = {"bundled": "bundled", "system-openblas": ""}


def _env(setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LOCALCTX_MLX_BLAS"}
    if SETTINGS[setting]:
        env["LOCALCTX_MLX_BLAS"] = SETTINGS[setting]
    return env


def sgemm(setting: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SGEMM], env=_env(setting), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run(setting: str, prompt: str, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "localctx.app.cli", "run", "--backend", "mlx", "--json", "--raw",
                          "--speculate", "off", "--max-tokens", str(max_tokens)], input=prompt, env=_env(setting),
                         capture_output=True, text=True, check=True)
    stats = json.loads(out.stdout)["stats"]
    return {k: stats[k] for k in ("prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s")}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/speed/mlx_blas.py")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-repeats", type=int, default=15)
    args = ap.parse_args()
    prompt = "Summarise this: " + "The cat sat on the mat and looked at the dog. " * args.prompt_repeats
    runs = {s: {"sgemm": [], "run": []} for s in SETTINGS}
    for i in range(args.pairs):
        order = list(SETTINGS) if i % 2 == 0 else list(reversed(SETTINGS))
        for setting in order:
            runs[setting]["sgemm"].append(sgemm(setting))
            runs[setting]["run"].append(run(setting, prompt, args.max_tokens))
        print(f"pair {i + 1}/{args.pairs} done", file=sys.stderr)
    import mlx.core as mx
    summary = {}
    for setting, r in runs.items():
        summary[setting] = {"blas": r["sgemm"][0]["blas"],
                            "sgemm_gflops": round(statistics.median(x["gflops"] for x in r["sgemm"]), 1),
                            "prefill_tok_s": round(statistics.median(x["prefill_tok_s"] for x in r["run"]), 2),
                            "decode_tok_s": round(statistics.median(x["decode_tok_s"] for x in r["run"]), 2)}
    b, s = summary["bundled"], summary["system-openblas"]
    print(json.dumps({"command": " ".join(["python benchmarks/speed/mlx_blas.py", *sys.argv[1:]]),
                      "machine": platform.processor() or platform.machine(), "mlx": mx.__version__,
                      "summary": summary,
                      "ratios": {k: round(s[k] / b[k], 2) for k in ("sgemm_gflops", "prefill_tok_s", "decode_tok_s")},
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
