"""Where the CPU time of a llama.cpp quality calibration goes (docs/quality.md "Calibration time"):
CPU and wall milliseconds per token of 256-token batches on one cache, with 2 threads or 1, with
logits for every position or only the last. On a busy machine, ggml's two threads spin at their
barriers (CPU time) and wait for each other (wall time); one thread per cache avoids both.

    python benchmarks/quality/llamacpp_eval_threads.py MODEL.gguf [--tokens 512] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import time


def run(path: str, threads: int, logits_all: bool, n: int) -> dict:
    import llama_cpp
    import pydoc_data.topics as topics
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=n + 16, n_threads=threads, n_threads_batch=threads, n_batch=512,
                type_k=llama_cpp.GGML_TYPE_F16, type_v=llama_cpp.GGML_TYPE_F16, verbose=False)
    ids = llm.tokenize("\n\n".join(topics.topics.values()).encode())[:n]
    cpu, wall = time.process_time(), time.perf_counter()
    for start in range(0, n, 256):
        llm._batch.set_batch(batch=ids[start:start + 256], n_past=start, logits_all=logits_all)
        llm._ctx.decode(llm._batch)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    llm.close()
    return {"threads": threads, "logits_all": logits_all, "tokens": n, "cpu_ms_per_token": 1000 * cpu / n,
            "wall_ms_per_token": 1000 * wall / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for threads, logits_all in ((2, True), (2, False), (1, True), (1, False)):
        rows.append(run(args.model, threads, logits_all, args.tokens))
        print(json.dumps(rows[-1]), flush=True)
    data = {"command": f"python benchmarks/quality/llamacpp_eval_threads.py {os.path.basename(args.model)} "
                       f"--tokens {args.tokens}", "model": args.model, "load_average": os.getloadavg(),
            "cpus": os.cpu_count(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
