"""KV bytes one token takes in one attention layer, per KV format, from the cost model
(kvcache/cost.py): arithmetic, not a measurement. Prints one JSON object (docs/benchmarks-cuda.md).

    python benchmarks/planner/kv_bytes_per_token.py --kv-heads 8 --head-dim 128 --group 32
"""
from __future__ import annotations

import argparse
import json

from localctx.kvcache.cost import layer_full_bytes, layer_quant_bytes
from localctx.kvcache.model_spec import LayerAttention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=32, help="quantization group (32 or 64)")
    args = ap.parse_args()
    layer = LayerAttention(n_kv_heads=args.kv_heads, k_dim=args.head_dim, v_dim=args.head_dim)
    rows = {"fp16": layer_full_bytes(layer, 2),
            "int8": layer_quant_bytes(layer, 8, 8, args.group, 2),
            "int4": layer_quant_bytes(layer, 4, 4, args.group, 2)}
    print(json.dumps({"layer": {"n_kv_heads": args.kv_heads, "head_dim": args.head_dim, "group_size": args.group},
                      "bytes_per_token_per_layer": rows,
                      "vs_fp16": {name: n / rows["fp16"] for name, n in rows.items()}}, indent=1))


if __name__ == "__main__":
    main()
