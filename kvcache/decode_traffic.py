"""Bytes one decode step's attention moves through memory, over every layer that holds KV: the
quantized codes, their fp16 scales and mins, the full-precision tokens (sinks, the residual, a
full-precision cache), the queries read and the outputs written; and what fp16 SDPA would move for
the same kept tokens (every one at the model's precision).

One function for everyone who projects decode from bytes: the planner's speed model
(``kvcache/speed.py``) takes its KV term and its fp16 floor from here, and the CUDA kernels'
projection (``benchmarks/cuda_check/projection.py``, docs/benchmarks-cuda.md) adds the queries and
outputs. The KV part equals ``cost.kv_bytes`` exactly (a test checks it): codes + scales is
``layer_quant_bytes`` × the quantized tokens, split into payload and group scales."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.kvcache import cost
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.policy import KVPolicy


@dataclass(frozen=True)
class StepTraffic:
    codes: int  # packed 4/8-bit payload of the quantized tokens (a 16-bit side counts here too)
    scales: int  # fp16 scale + min of every quantization group read
    full_tokens: int  # K and V of the full-precision tokens
    queries: int  # one new token's queries, read once per layer
    outputs: int  # its attention output, written once per layer
    sdpa_kv: int  # K and V of the same kept tokens at the model's precision (what fp16 SDPA reads)

    @property
    def kv(self) -> int:
        """The cache bytes the step reads (= ``cost.kv_bytes``)."""
        return self.codes + self.scales + self.full_tokens

    @property
    def total(self) -> int:
        return self.kv + self.queries + self.outputs

    @property
    def sdpa_total(self) -> int:
        return self.sdpa_kv + self.queries + self.outputs


def _side(width: int, bits: int, group_size: int, elem_bytes: int) -> tuple[int, int]:
    """(payload, scale+min) bytes one quantized token takes on one side; sums to ``cost.side_quant_bytes``."""
    whole = cost.side_quant_bytes(width, bits, group_size, elem_bytes)
    payload = width * elem_bytes if bits == 16 else width * bits // 8
    return payload, whole - payload


def step_traffic(spec: ModelSpec, policy: KVPolicy, n_tokens: int) -> StepTraffic:
    """The bytes of one decode step after ``n_tokens`` tokens have streamed through the cache."""
    codes = scales = full = queries = sdpa = 0
    elem = spec.kv_elem_bytes
    for layer, count in spec.layer_groups():
        lp = cost.layer_policy(policy, layer)
        if lp is None:
            continue
        quantized, kept_full = cost.split_tokens(lp, n_tokens)
        if quantized:
            k_pay, k_sc = _side(layer.k_width, lp.k_bits, lp.group_size, elem)
            v_pay, v_sc = _side(layer.v_width, lp.v_bits, lp.group_size, elem)
            codes += count * quantized * (k_pay + v_pay)
            scales += count * quantized * (k_sc + v_sc)
        full += count * kept_full * cost.layer_full_bytes(layer, elem)
        sdpa += count * lp.kept_tokens(max(0, n_tokens)) * cost.layer_full_bytes(layer, elem)
        queries += count * spec.n_heads * layer.k_dim * elem
    outputs = sum(count * spec.n_heads * layer.v_dim * elem for layer, count in spec.layer_groups() if layer.holds_kv)
    return StepTraffic(codes, scales, full, queries, outputs, sdpa)
