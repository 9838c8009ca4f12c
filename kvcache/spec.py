"""ModelSpec: the shape of a model, read without loading its weights (readers live in backends/)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int  # trained context
    rope_base: float = 10000.0
    weight_bytes: int = 0  # bytes of the weights as stored (what decode reads per step)
    n_params: int = 0
    kv_elem_bytes: int = 2  # full-precision KV element: 2 for fp16/bf16, 4 for fp32
    intermediate_size: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in names})
