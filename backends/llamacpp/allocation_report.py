"""llama.cpp's own report of the KV cache it allocates, to check ``allocation`` against.

``reported_caches`` loads a GGUF in a child process with llama.cpp's log on, opens one context
per setting, and reads the ``llama_kv_cache: size = … (N cells, L layers, …), K (type): X MiB,
V (type): Y MiB`` lines llama.cpp prints for each cache it creates (two for a model with sliding
layers: the non-SWA cache, then the SWA one). llama.cpp prints MiB with two decimals, so bytes
compare to ±0.005 MiB; cells and layers compare exactly."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from localctx.backends.llamacpp.allocation import LlamaCppCache

MiB = 1024 * 1024
_LINE = re.compile(r"llama_kv_cache: size = +[0-9.]+ MiB \( *(\d+) cells, +(\d+) layers,.*?\), "
                   r"K \((\w+)\): +([0-9.]+) MiB, V \((\w+)\): +([0-9.]+) MiB")
_MARK = "localctx-kv-report: context"


@dataclass(frozen=True)
class ReportedCache:
    cells: int
    layers: int
    k_mib: float
    v_mib: float


def reported_caches(path: Path, settings: list[LlamaCppCache], timeout: float = 120) -> list[list[ReportedCache]]:
    """For each setting, the caches llama.cpp reports creating (in its order)."""
    args = json.dumps([asdict(s) for s in settings])
    proc = subprocess.run([sys.executable, "-m", "localctx.backends.llamacpp.allocation_report", str(path), args],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp could not load {path.name}: {proc.stderr[-800:]}")
    out: list[list[ReportedCache]] = []
    for line in proc.stderr.splitlines():
        if line.startswith(_MARK):
            out.append([])
            continue
        m = _LINE.search(line)
        if m and out:
            out[-1].append(ReportedCache(int(m.group(1)), int(m.group(2)), float(m.group(4)), float(m.group(6))))
    if len(out) != len(settings):
        raise RuntimeError(f"expected {len(settings)} contexts in llama.cpp's log, read {len(out)}")
    return out


def _open_contexts(path: str, settings: list[dict]) -> None:
    import llama_cpp

    from localctx.backends.llamacpp.session import set_llama_log

    set_llama_log(True)  # llama.cpp's log to stderr, where the parent reads it
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise SystemExit(f"cannot load {path}")
    for s in settings:
        cache = LlamaCppCache(**s)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = cache.n_ctx
        params.n_batch = max(cache.n_ubatch, 512)
        params.n_ubatch = cache.n_ubatch
        params.n_threads = params.n_threads_batch = 1
        params.type_k = getattr(llama_cpp, f"GGML_TYPE_{cache.type_k.upper()}")
        params.type_v = getattr(llama_cpp, f"GGML_TYPE_{cache.type_v.upper()}")
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if cache.flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.swa_full = cache.swa_full
        print(f"{_MARK} {s}", file=sys.stderr, flush=True)
        ctx = llama_cpp.llama_init_from_model(model, params)
        if not ctx:
            raise SystemExit(f"llama.cpp refused a context with {s}")
        llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    _open_contexts(sys.argv[1], json.loads(sys.argv[2]))
