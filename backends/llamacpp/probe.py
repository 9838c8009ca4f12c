"""The child process of backends/llamacpp/guard.py: load a small GGUF with llama.cpp and decode a
few tokens on several threads, once with full-precision KV and once with 8-bit KV through flash
attention (the kernels a session uses). Prints OK_LINE when all of it ran; a build that executes
an instruction this CPU or OS does not allow dies here (SIGILL), not in the user's process.

Run as ``python -m localctx.backends.llamacpp.probe MODEL.gguf``; imports nothing of localctx."""
from __future__ import annotations

import os
import sys

OK_LINE = "llama.cpp probe: ok"
GGML_TYPE_Q8_0 = 8


def probe(model_path: str) -> None:
    from llama_cpp import Llama

    threads = max(2, min(4, os.cpu_count() or 2))  # worker threads too: AMX failed on those only
    for kv in ({}, {"type_k": GGML_TYPE_Q8_0, "type_v": GGML_TYPE_Q8_0, "flash_attn": True}):
        llm = Llama(model_path=model_path, n_ctx=64, n_batch=32, n_threads=threads, n_threads_batch=threads,
                    verbose=False, **kv)
        prompt = llm.tokenize(b"The sky is blue because sunlight scatters in the air", add_bos=True)
        llm.eval(prompt)  # a batch: matrix-matrix kernels
        for _ in range(3):  # single tokens: matrix-vector kernels
            llm.eval([llm.sample(top_k=1)])
        llm.close()


if __name__ == "__main__":
    probe(sys.argv[1])
    print(OK_LINE, flush=True)
