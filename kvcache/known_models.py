"""Known model shapes (assets/models.json), so ``localctx plan -m llama-3-8b`` plans without weights."""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from localctx.kvcache.spec import ModelSpec


@lru_cache(maxsize=1)
def _models() -> dict:
    return json.loads(resources.files("localctx.assets").joinpath("models.json").read_text())["models"]


def names() -> list[str]:
    return list(_models())


def known_spec(name: str) -> ModelSpec | None:
    """The spec of a known model by its key (``llama-3-8b``) or hub id, case-insensitive; else None."""
    key = name.strip().lower()
    for k, entry in _models().items():
        if key == k or (entry.get("hf_id") and key == entry["hf_id"].lower()):
            return ModelSpec.from_dict(entry)
    return None
