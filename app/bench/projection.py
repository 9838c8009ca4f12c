"""What each measurement is compared against: the cost model's KV bytes, the bandwidth roofline
(tok/s ≤ bandwidth / (weight bytes + KV bytes read per step)), and the planner's projection where a
planner is part of this build."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.kvcache import cost
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.spec import ModelSpec


@dataclass(frozen=True)
class Bandwidth:
    bytes_s: float
    source: str  # how it was found, said in the report

    def to_dict(self) -> dict:
        return {"bytes_s": self.bytes_s, "source": self.source}


def detect_bandwidth(threads: int) -> Bandwidth:
    from localctx.app.bench.machine import probe_bandwidth

    return Bandwidth(probe_bandwidth(threads),
                     f"measured now: {threads}-thread numpy copy of 256 MiB, best of 5 (no planner in this build)")


@dataclass(frozen=True)
class Projection:
    kv_bytes: int  # the cost model's bytes for the measured stream length
    roofline_decode_tok_s: float
    planner_decode_tok_s: float | None = None
    source: str = "roofline"


def project(spec: ModelSpec, policy: KVPolicy, context: int, stream_tokens: int, bw: Bandwidth) -> Projection:
    kv_read = cost.kv_bytes(spec, policy, context)  # what attention reads per decode step at this context
    return Projection(kv_bytes=cost.kv_bytes(spec, policy, stream_tokens),
                      roofline_decode_tok_s=cost.decode_tok_s_roofline(bw.bytes_s, spec.weight_bytes, kv_read))
