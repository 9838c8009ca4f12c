"""Known model shapes (assets/models.json), so ``localctx plan -m gemma-3-27b`` plans without weights.

An entry holds ModelSpec's fields, plus what its published config.json says about attention and
experts: ``sliding_window`` with ``swa_pattern`` (the period of llama.cpp's pattern, kvcache/layouts.py;
the architecture's own when absent) or ``layer_types`` (one "sliding_attention"/"full_attention" per
layer), ``v_head_dim`` where V's head dim differs from K's, and ``moe`` (``n_experts``, ``n_active``,
``expert_params``: the routed experts' parameters; their bytes are that share of ``weight_bytes``).
``source`` names the config the numbers come from."""
from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from importlib import resources

from localctx.kvcache.layouts import build_layers, pattern_for
from localctx.kvcache.model_spec import MoE, ModelSpec


@lru_cache(maxsize=1)
def _models() -> dict:
    return json.loads(resources.files("localctx.assets").joinpath("models.json").read_text())["models"]


def names() -> list[str]:
    return list(_models())


def spec_from_entry(entry: dict) -> ModelSpec:
    spec = ModelSpec.from_dict({k: v for k, v in entry.items() if k != "moe"})
    n = spec.n_layers
    window = entry.get("sliding_window")
    types = entry.get("layer_types")
    if isinstance(types, list):
        sliding = [t == "sliding_attention" for t in types]
    else:
        sliding, window = pattern_for(spec.architecture, n, window, entry.get("swa_pattern"))
    layers = build_layers(n, [spec.n_kv_heads] * n, spec.head_dim, entry.get("v_head_dim") or spec.head_dim,
                          sliding, window)
    moe = None
    if entry.get("moe"):
        m = entry["moe"]
        share = m["expert_params"] / spec.n_params
        moe = MoE(m["n_experts"], m["n_active"], expert_bytes=int(spec.weight_bytes * share),
                  expert_params=m["expert_params"])
    uniform = all(x.kind == "full" for x in layers) and not entry.get("v_head_dim")
    return replace(spec, layers=() if uniform else layers, moe=moe)


def known_spec(name: str) -> ModelSpec | None:
    """The spec of a known model by its key (``llama-3-8b``) or hub id, case-insensitive; else None."""
    key = name.strip().lower()
    for k, entry in _models().items():
        if key == k or (entry.get("hf_id") and key == entry["hf_id"].lower()):
            return spec_from_entry(entry)
    return None
