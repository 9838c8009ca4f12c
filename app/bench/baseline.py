"""The baseline: plain llama-cpp-python with its default settings, on the same GGUF, prompt and
generation length. Only n_ctx (to hold the context) and n_threads (the count localctx's llama.cpp
backend uses, so the comparison is fair) are set; KV stays llama.cpp's default f16, flash attention
off, batch sizes default. Timing is the same as the shared generation loop's: prefill is the wait for
the first token, decode the steps after it."""
from __future__ import annotations

import time

from localctx.app.bench.measure import MeasureRequest, Sample
from localctx.app.bench.memory import PeakTracker
from localctx.app.bench.prompt import fit_text
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError
from localctx.kvcache.policy import KVPolicy


def baseline_settings(threads: int) -> dict:
    return {"library": "llama-cpp-python", "n_threads": threads, "n_ctx": "the measured context",
            "everything else": "llama-cpp-python defaults (f16 KV, flash_attn off, n_batch 512)"}


def llama_cpp_version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "unknown"))


def measure_baseline(req: MeasureRequest, tracker: PeakTracker) -> Sample:
    import llama_cpp
    from llama_cpp import Llama

    from localctx.backends.models.spec_reader import read_spec
    from localctx.backends.models.ref import resolve

    ref = resolve(req.model)
    if ref.kind != "gguf":
        raise UserError(f"the llama.cpp baseline needs a GGUF model and {ref.name} is not one")
    spec = read_spec(ref)
    tracker.reset()
    t0 = time.perf_counter()
    llm = Llama(model_path=str(ref.path), n_ctx=req.context, n_threads=req.threads, verbose=False)
    load_s = time.perf_counter() - t0
    try:
        def count(text: str) -> int:
            return len(llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))

        ids = llm.tokenize(fit_text(count, req.context - req.gen_tokens).encode("utf-8"), add_bos=True,
                           special=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        stamps: list[float] = []
        finish = "length"
        start = time.perf_counter()
        for token in llm.generate(ids, top_k=0, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            stamps.append(time.perf_counter())
            if llama_cpp.llama_vocab_is_eog(vocab, token):  # end of generation, as localctx stops
                finish = "stop"
                break
            if len(stamps) == req.gen_tokens:
                break
        peak = tracker.read()
        generated = len(stamps) - (finish == "stop")
        decode_steps = generated - 1  # the first token comes out of prefill (as in the shared loop)
        decode_s = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
        n_tokens = int(llm.n_tokens)
        return Sample(prompt_tokens=len(ids), generated_tokens=generated,
                      prefill_tok_s=len(ids) / (stamps[0] - start) if stamps else 0.0,
                      decode_tok_s=decode_steps / decode_s if decode_s > 0 else 0.0,
                      kv_bytes=cost.kv_bytes(spec, KVPolicy(), n_tokens), kv_tokens=n_tokens,
                      peak_rss_bytes=peak.rss_bytes, peak_scope=peak.scope, load_s=load_s, finish_reason=finish)
    finally:
        llm.close()
