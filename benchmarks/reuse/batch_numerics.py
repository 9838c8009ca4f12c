"""Where llama.cpp's T-token batch rounds differently from its one-token step, per context setting.

For one GGUF, the same token after the same prompt is decoded alone and as the first row of a
T-token batch (llama.cpp's low-level API, fresh context each time); printed per setting (flash
attention on/off, CPU weight repacking ``use_extra_bufts`` on/off) and T: the largest absolute logit
difference over the prompt lengths tried. 0.0 means bit-for-bit equal logits.

    python benchmarks/reuse/batch_numerics.py MODEL.gguf --json docs/results/reuse/batch-numerics-NAME.json
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np

TEXT = ("The history of the city begins in the early middle ages, when a small market grew around the river "
        "crossing and merchants from the north brought wool, salt and iron to trade for grain and wine. ") * 6


def main(argv=None) -> int:
    import llama_cpp as L

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--lengths", default="13,49", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--steps", default="1,2,3,4,8", help="batch sizes T, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    steps = [int(x) for x in args.steps.split(",")]
    L.llama_backend_init()
    quiet = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(quiet, None)

    def decode(ctx, toks, pos0):
        b = L.llama_batch_init(len(toks), 0, 1)
        for j, t in enumerate(toks):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, pos0 + j, 1, 1
            b.seq_id[j][0] = 0
        b.n_tokens = len(toks)
        code = L.llama_decode(ctx, b)
        L.llama_batch_free(b)
        if code != 0:
            raise SystemExit(f"llama_decode failed ({code})")

    rows = []
    for extra in (True, False):
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = extra
        model = L.llama_model_load_from_file(str(args.model).encode(), mp)
        vocab = L.llama_model_get_vocab(model)
        n_vocab = L.llama_vocab_n_tokens(vocab)
        buf = (L.llama_token * 4096)()
        ids = list(buf[:L.llama_tokenize(vocab, TEXT.encode(), len(TEXT.encode()), buf, 4096, True, False)])
        for fa in (False, True):
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = 1024, 512, 512
            cp.n_threads = cp.n_threads_batch = args.threads
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
            ctx = L.llama_init_from_model(model, cp)
            worst = {}
            for n, T in itertools.product(lengths, steps):
                rows_ = []
                for size in (1, T):
                    L.llama_memory_clear(L.llama_get_memory(ctx), True)
                    decode(ctx, ids[:n], 0)
                    decode(ctx, [ids[n]] * size, n)
                    rows_.append(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, 0), shape=(n_vocab,)).copy())
                diff = float(np.abs(rows_[0] - rows_[1]).max())
                worst[T] = max(worst.get(T, 0.0), round(diff, 4))
            L.llama_free(ctx)
            rows.append({"repack": extra, "flash_attn": fa, "max_abs_logit_diff_by_T": worst})
            print(json.dumps(rows[-1]), flush=True)
        L.llama_model_free(model)
    if args.json:
        args.json.write_text(json.dumps({
            "command": "python benchmarks/reuse/batch_numerics.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": args.model.name, "lengths": lengths, "threads": args.threads,
            "load": os.getloadavg()[0], "llama_cpp_python": L.__version__, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
