"""ModelSpec: the shape of a model, read without loading its weights (readers live in backends/).

Attention is described layer by layer (``LayerAttention``): full, sliding with its window, or none
(a recurrent or linear-attention layer that holds no KV), with its KV heads and K and V head dims
(which can differ). A spec read without per-layer facts has ``layers == ()`` and every layer is full
attention with the spec's ``n_kv_heads`` × ``head_dim``; ``attention()`` gives the layers either way.
Mixture-of-experts models carry ``MoE``: how many experts, how many one token routes to, and the
bytes of the routed experts, so a decoded token reads the dense weights plus its active experts."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace

FULL, SLIDING, NONE = "full", "sliding", "none"


@dataclass(frozen=True)
class LayerAttention:
    kind: str = FULL  # "full", "sliding" (``window`` tokens) or "none" (holds no KV)
    n_kv_heads: int = 0
    k_dim: int = 0  # K head dim
    v_dim: int = 0  # V head dim
    window: int | None = None  # sliding layers: the most recent tokens a query attends to

    def __post_init__(self) -> None:
        if self.kind not in (FULL, SLIDING, NONE):
            raise ValueError(f"layer kind {self.kind!r} is not full, sliding or none")
        if self.kind == SLIDING and not (self.window and self.window > 0):
            raise ValueError("a sliding layer needs a positive window")

    @property
    def holds_kv(self) -> bool:
        return self.kind != NONE and self.n_kv_heads > 0

    @property
    def k_width(self) -> int:
        """K elements one token adds to this layer."""
        return self.n_kv_heads * self.k_dim if self.holds_kv else 0

    @property
    def v_width(self) -> int:
        return self.n_kv_heads * self.v_dim if self.holds_kv else 0


@dataclass(frozen=True)
class MoE:
    n_experts: int  # routed experts per MoE layer
    n_active: int  # experts each token is routed to
    expert_bytes: int  # bytes of every routed expert's weights, all layers together (as stored)
    expert_params: int = 0

    def active_bytes(self) -> int:
        """Bytes of the routed experts one token reads (its ``n_active`` of ``n_experts``)."""
        return self.expert_bytes * self.n_active // self.n_experts

    def active_params(self) -> int:
        return self.expert_params * self.n_active // self.n_experts


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
    weight_bytes: int = 0  # bytes of the weights as stored
    n_params: int = 0
    kv_elem_bytes: int = 2  # full-precision KV element: 2 for fp16/bf16, 4 for fp32
    intermediate_size: int = 0
    layers: tuple[LayerAttention, ...] = ()  # () = every layer full attention, n_kv_heads × head_dim
    moe: MoE | None = None
    assumptions: tuple[str, ...] = field(default=())  # what the reader did not know and assumed

    def __post_init__(self) -> None:
        if self.layers and len(self.layers) != self.n_layers:
            raise ValueError(f"{len(self.layers)} layer descriptions for {self.n_layers} layers")

    def attention(self) -> tuple[LayerAttention, ...]:
        """Every layer's attention (the uniform full-attention default when none was read)."""
        if self.layers:
            return self.layers
        return (LayerAttention(FULL, self.n_kv_heads, self.head_dim, self.head_dim),) * self.n_layers

    def layer_groups(self) -> list[tuple[LayerAttention, int]]:
        """Distinct layer descriptions and how many layers share each (cost arithmetic runs per group)."""
        return list(Counter(self.attention()).items())

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decoded token reads: all of a dense model; the dense part plus the active
        experts of a mixture of experts."""
        if self.moe is None:
            return self.weight_bytes
        return self.weight_bytes - self.moe.expert_bytes + self.moe.active_bytes()

    @property
    def active_params(self) -> int:
        if self.moe is None or not self.moe.expert_params:
            return self.n_params
        return self.n_params - self.moe.expert_params + self.moe.active_params()

    def with_name(self, name: str) -> "ModelSpec":
        return replace(self, name=name)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layers"] = [asdict(layer) for layer in self.layers]
        out["assumptions"] = list(self.assumptions)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        names = cls.__dataclass_fields__.keys()
        values = {k: v for k, v in data.items() if k in names}
        values["layers"] = tuple(LayerAttention(**layer) for layer in values.get("layers") or ())
        moe = values.get("moe")
        values["moe"] = MoE(**moe) if isinstance(moe, dict) else moe
        values["assumptions"] = tuple(values.get("assumptions") or ())
        return cls(**values)


def _period(kinds: list[str]) -> int:
    """The shortest repeat of the layer kinds (the whole stack when nothing repeats)."""
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def describe_layout(spec: ModelSpec) -> str:
    """One line: 'full attention', '5 local : 1 global, window 512', '36 none (recurrent) + 12 full' ..."""
    layers = spec.attention()
    kinds = Counter(layer.kind for layer in layers)
    windows = sorted({layer.window for layer in layers if layer.kind == SLIDING})
    if kinds[SLIDING] and kinds[FULL] and not kinds[NONE]:
        period = _period([layer.kind for layer in layers])
        local = sum(1 for layer in layers[:period] if layer.kind == SLIDING)
        out = f"{local} local : {period - local} global, window {', '.join(f'{w:,}' for w in windows)}"
    elif kinds[SLIDING] and not kinds[FULL] and not kinds[NONE]:
        out = f"all sliding, window {', '.join(f'{w:,}' for w in windows)}"
    elif kinds[NONE]:
        parts = [f"{kinds[NONE]} without KV (recurrent/linear)"]
        parts += [f"{kinds[FULL]} full"] if kinds[FULL] else []
        parts += [f"{kinds[SLIDING]} sliding (window {', '.join(map(str, windows))})"] if kinds[SLIDING] else []
        out = " + ".join(parts)
    else:
        out = "full attention"
    if spec.moe:
        out += f"; MoE {spec.moe.n_active} of {spec.moe.n_experts} experts"
    return out
