"""KVPolicy and its short text form, e.g. ``int4+res128+sink4+win4096``.

Tokens, joined by ``+``, in any order on input and canonical order on output:

- precision: ``fp16`` (the model's full precision; ``f16``/``bf16``/``full`` accepted), ``int8``, ``int4``
  for keys and values alike, or keys and values apart as ``k<P>v<P>`` with P one of ``f16`` (``16``,
  ``fp16``), ``8``, ``4``: e.g. ``k8v4`` (8-bit keys, 4-bit values), ``kf16v4`` (full-precision keys).
  Canonical output: ``fp16``/``int8``/``int4`` when both sides agree, else ``k8v4``, ``kf16v8`` …
- ``gN``: quantization group size (32 or 64; default 32); with either side quantized
- ``resN``: the N most recent tokens stay in full precision (with either side quantized)
- ``sinkN``: the first N tokens are always kept
- ``winN``: the last N tokens are kept; the middle is evicted (no ``win`` = unbounded)
- ``heavyN``: of the tokens the window evicts, the N with the largest accumulated attention are kept
  too (H2O); needs ``winN``
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from localctx.kvcache.errors import UserError

_PRECISIONS = {"fp16": 16, "f16": 16, "bf16": 16, "full": 16, "int8": 8, "q8": 8, "int4": 4, "q4": 4}
_SIDE = {"f16": 16, "fp16": 16, "16": 16, "8": 8, "4": 4}
_SPLIT = re.compile(r"^k([a-z0-9]+)v([a-z0-9]+)$")
_FIELD = re.compile(r"^(g|res|sink|win|heavy)(\d+)$")
GROUP_SIZES = (32, 64)
EXAMPLE = "int4+res128+sink4+win4096"


@dataclass(frozen=True)
class KVPolicy:
    """``k_bits`` / ``v_bits``: the precision keys and values are held at (16 = the model's own)."""
    k_bits: int = 16
    v_bits: int = 16
    group_size: int = 32
    residual: int = 0
    sinks: int = 0
    window: int | None = None
    heavy: int = 0

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise UserError(f"invalid KV policy {self._raw()!r}: {problem}")

    def _raw(self) -> str:
        """The policy as it is written (``int8+heavy8``) where its precisions can be written, else its fields."""
        if {self.k_bits, self.v_bits} <= {16, 8, 4}:
            return str(self)
        return (f"k_bits={self.k_bits} v_bits={self.v_bits} g={self.group_size} res={self.residual} sinks={self.sinks} "
                f"window={self.window} heavy={self.heavy}")

    def _problem(self) -> str | None:
        if self.k_bits not in (16, 8, 4) or self.v_bits not in (16, 8, 4):
            return "key and value precision must each be 16, 8 or 4 bits (fp16, int8, int4, or e.g. k8v4)"
        if self.group_size not in GROUP_SIZES:
            return f"group size must be one of {GROUP_SIZES} (e.g. g32)"
        if min(self.residual, self.sinks, self.heavy) < 0:
            return "counts must not be negative"
        if self.window is not None and self.window < 1:
            return "window must be at least 1 token (drop 'win' for an unbounded cache)"
        if self.residual and not self.quantized:
            return "a full-precision residual ('res') only applies to quantized KV (int8, int4, k8v4, ...)"
        if self.heavy and self.window is None:
            return ("heavy hitters ('heavy') are kept from the tokens a window evicts, and without 'win' "
                    "nothing is evicted; add a window (e.g. int8+sink4+win2048+heavy256) or drop 'heavy'")
        return None

    # -- text form -------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "KVPolicy":
        src = text.strip().lower()
        if not src:
            raise UserError(f"empty KV policy: give one like {EXAMPLE!r} or 'fp16'")
        parts = [p.strip() for p in src.split("+")]
        fields: dict[str, int] = {}
        bits: tuple[int, int] | None = None
        for part in parts:
            precision = _precision(text, part)
            if precision is not None:
                if bits is not None:
                    raise UserError(f"KV policy {text!r} names two precisions; keep one of fp16, int8, int4 "
                                    "or one k<P>v<P> such as k8v4")
                bits = precision
                continue
            m = _FIELD.match(part)
            if not m:
                raise UserError(
                    f"KV policy {text!r}: unknown part {part!r}; use fp16|int8|int4 (or k8v4, kf16v4, ...) and "
                    f"gN, resN, sinkN, winN, heavyN joined by '+', e.g. {EXAMPLE!r}")
            key, val = m.group(1), int(m.group(2))
            if key in fields:
                raise UserError(f"KV policy {text!r} gives {key!r} twice; keep one")
            fields[key] = val
        if fields.get("win") == 0:
            raise UserError(f"KV policy {text!r}: win0 keeps nothing; drop 'win' for an unbounded cache")
        k_bits, v_bits = bits or (16, 16)
        if "g" in fields and min(k_bits, v_bits) == 16:
            raise UserError(f"KV policy {text!r}: a group size only applies to quantized KV (int8, int4, k8v4, ...)")
        return cls(k_bits=k_bits, v_bits=v_bits, group_size=fields.get("g", 32), residual=fields.get("res", 0),
                   sinks=fields.get("sink", 0), window=fields.get("win"), heavy=fields.get("heavy", 0))

    def __str__(self) -> str:
        parts = [self.precision]
        if self.quantized and self.group_size != 32:
            parts.append(f"g{self.group_size}")
        if self.residual:
            parts.append(f"res{self.residual}")
        if self.sinks:
            parts.append(f"sink{self.sinks}")
        if self.window is not None:
            parts.append(f"win{self.window}")
        if self.heavy:
            parts.append(f"heavy{self.heavy}")
        return "+".join(parts)

    # -- properties the planner and the UI ask ---------------------------------
    @property
    def precision(self) -> str:
        """The precision token: ``fp16``, ``int8``, ``int4`` when keys and values agree, else e.g. ``k8v4``."""
        if self.k_bits == self.v_bits:
            return "fp16" if self.k_bits == 16 else f"int{self.k_bits}"
        return f"k{_side_text(self.k_bits)}v{_side_text(self.v_bits)}"

    @property
    def quantized(self) -> bool:
        """Either keys or values are held below full precision."""
        return min(self.k_bits, self.v_bits) < 16

    @property
    def split(self) -> bool:
        """Keys and values are held at different precisions."""
        return self.k_bits != self.v_bits

    @property
    def evicts(self) -> bool:
        """True when tokens can be dropped from the cache (a window bounds it)."""
        return self.window is not None

    @property
    def exact(self) -> bool:
        """Full precision and nothing evicted: attention sees exactly what the model would."""
        return not self.quantized and not self.evicts

    def capacity(self) -> int | None:
        """Most tokens the cache ever holds; None when unbounded."""
        if self.window is None:
            return None
        return self.sinks + self.heavy + self.window

    def kept_tokens(self, n_tokens: int) -> int:
        """Tokens held after ``n_tokens`` have streamed through the cache."""
        cap = self.capacity()
        return n_tokens if cap is None else min(n_tokens, cap)


FP16 = KVPolicy()


def uniform(bits: int, **fields) -> KVPolicy:
    """A policy with keys and values at the same ``bits`` (16, 8 or 4)."""
    return KVPolicy(k_bits=bits, v_bits=bits, **fields)


def uniform_bits(policy: KVPolicy) -> int:
    """The one precision of a cache that holds keys and values alike; a split policy is refused."""
    if policy.split:
        raise UserError(f"this cache holds keys and values at one precision and {policy} splits them "
                        f"({policy.precision}); use int{min(policy.k_bits, policy.v_bits)} or another backend")
    return policy.k_bits


def precision_words(k_bits: int, v_bits: int) -> str:
    """'8-bit KV', or 'full-precision keys, 4-bit values' when the sides differ."""
    if k_bits == v_bits:
        return "full-precision KV" if k_bits == 16 else f"{k_bits}-bit KV"
    word = lambda bits: "full-precision" if bits == 16 else f"{bits}-bit"
    return f"{word(k_bits)} keys, {word(v_bits)} values"


def _side_text(bits: int) -> str:
    return "f16" if bits == 16 else str(bits)


def _precision(text: str, part: str) -> tuple[int, int] | None:
    """(k_bits, v_bits) for a precision token, None for a part that is not one."""
    if part in _PRECISIONS:
        return _PRECISIONS[part], _PRECISIONS[part]
    m = _SPLIT.match(part)
    if not m:
        return None
    k, v = m.group(1), m.group(2)
    if k not in _SIDE or v not in _SIDE:
        raise UserError(f"KV policy {text!r}: {part!r} gives keys and values apart, each f16, 8 or 4 "
                        "(e.g. k8v4, kf16v8, kf16v4)")
    return _SIDE[k], _SIDE[v]


def layer_policy(policy: KVPolicy, model_window: int | None) -> KVPolicy:
    """The policy one layer of a model runs. A full-attention layer (``model_window`` None) runs
    ``policy``. A layer that attends only over its own window of the last ``model_window`` tokens
    (Gemma's local layers) keeps the smaller of the two windows: where the policy's window is
    smaller, the policy applies there as on any layer (its sinks and heavy hitters too); otherwise
    the layer keeps exactly the model's window, at the policy's precision, and no sinks or heavy
    hitters (the model never sees those tokens on that layer)."""
    if model_window is None or (policy.window is not None and policy.window < model_window):
        return policy
    return dataclasses.replace(policy, window=model_window, sinks=0, heavy=0)

