"""Projected decode and prefill speed: the bandwidth roofline, corrected by a backend's calibration.

Uncalibrated, a decode step reads the weights (a mixture of experts: its dense weights and the
active experts, ``ModelSpec.decode_weight_bytes``) and the KV once at the machine's bandwidth, and
quantized KV is assumed to cost what fp16 KV costs (no speed-up is assumed from fewer bytes:
dequantisation is work, and on some machines it is the larger cost). Calibrated, each format has
its own measured cost per KV byte, and the step's fixed part is the calibration model's measured
time, moved by the difference in weight bytes at the machine's bandwidth."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.kvcache import cost, decode_traffic
from localctx.kvcache.calibration import Calibration, FormatCost
from localctx.kvcache.hardware_profile import HardwareProfile
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import ModelSpec


@dataclass(frozen=True)
class SpeedModel:
    hardware: HardwareProfile
    calibration: Calibration | None = None

    def calibrated(self, policy: KVPolicy) -> bool:
        return self._cost(policy) is not None

    def _cost(self, policy: KVPolicy) -> FormatCost | None:
        return self.calibration.cost_for(policy.precision, policy.evicts) if self.calibration is not None else None

    def basis(self, policy: KVPolicy) -> str:
        if self.calibrated(policy):
            return f"calibrated ({self.calibration.source or 'measured'})"
        return "bandwidth roofline (uncalibrated; quantized KV assumed no faster than fp16)"

    def step_seconds(self, spec: ModelSpec, policy: KVPolicy, kv_tokens: int) -> float:
        """Seconds per decode step with ``kv_tokens`` tokens having streamed through the cache."""
        bw = self.hardware.bandwidth_bytes_s
        traffic = decode_traffic.step_traffic(spec, policy, kv_tokens)  # the CUDA projection's byte counts too
        kv = traffic.kv
        fc = self._cost(policy)
        if fc is not None:
            cal = self.calibration
            step = fc.step_s(kv)
            read = spec.decode_weight_bytes
            if read != cal.weight_bytes:  # another model: move by its extra weight reads
                fixed = max(fc.base_s + (read - cal.weight_bytes) / bw, read / bw / 4)
                step += fixed - fc.base_s
            return step
        return (spec.decode_weight_bytes + max(kv, traffic.sdpa_kv)) / bw

    def decode_tok_s(self, spec: ModelSpec, policy: KVPolicy, kv_tokens: int) -> float:
        return 1.0 / self.step_seconds(spec, policy, kv_tokens)

    def worst_decode_tok_s(self, spec: ModelSpec, policy: KVPolicy, context: int) -> float:
        """The slowest point of a stream of ``context`` tokens (a bounded cache stops slowing down)."""
        cap = policy.capacity()
        return self.decode_tok_s(spec, policy, context if cap is None else min(context, cap))

    def max_cached_tokens(self, spec: ModelSpec, policy: KVPolicy, min_tok_s: float) -> int:
        """Most tokens the cache may hold while decode stays at or above ``min_tok_s`` (0 if never)."""
        target_s = 1.0 / min_tok_s
        if self.step_seconds(spec, policy, 0) > target_s:
            return 0
        lo, hi = 0, 1
        while self.step_seconds(spec, policy, hi) <= target_s:
            if hi > 1 << 30:
                return hi
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.step_seconds(spec, policy, mid) <= target_s:
                lo = mid
            else:
                hi = mid
        return lo

    def prefill_tok_s(self, spec: ModelSpec, n_tokens: int) -> float | None:
        """Compute-bound estimate: FLOPs of the prompt over the machine's (or calibrated) FLOP/s."""
        flops_s = self.calibration.prefill_flops_s if self.calibration and self.calibration.prefill_flops_s \
            else self.hardware.compute_flops * 0.5
        if flops_s <= 0 or n_tokens <= 0:
            return None
        return n_tokens / (cost.prefill_flops(spec, n_tokens) / flops_s)
