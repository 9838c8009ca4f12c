"""Write the bundled SmolLM2-135M (Q4_1) again in another llama.cpp weight format, with llama.cpp's
own quantizer (``llama_model_quantize``, requantizing): for benchmarks that compare how the
weight format changes an engine's cost (docs/benchmarks-reuse.md: a verify step on Q8_0 weights
against Q4_1). The new file holds the same model up to the two formats' rounding; it is not a
model anyone ships, and figures made with it say so.

    python benchmarks/tools/requantize.py q8_0 /tmp/smollm2-q8_0.gguf
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile

FORMATS = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "f16": "LLAMA_FTYPE_MOSTLY_F16"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("format", choices=sorted(FORMATS))
    ap.add_argument("out", help="where to write the GGUF (written whole, then moved into place)")
    args = ap.parse_args()
    import llama_cpp

    from localctx.backends.models.ref import resolve

    source = resolve(None).path
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FORMATS[args.format])
    params.allow_requantize = True
    directory = os.path.dirname(os.path.abspath(args.out))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".requantize.", suffix=".gguf")
    os.close(fd)
    try:
        if llama_cpp.llama_model_quantize(str(source).encode(), tmp.encode(), ctypes.byref(params)) != 0:
            sys.exit(f"llama.cpp could not requantize {source.name} to {args.format}")
        os.replace(tmp, args.out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"{source.name} → {args.out} ({args.format}, {os.path.getsize(args.out):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
