"""What each measurement is compared against: the cost model's KV bytes, the bandwidth roofline
(tok/s ≤ bandwidth / (weight bytes + KV bytes read per step), with the bandwidth measured at the start
of the run), and the planner's own projection (its speed model: calibrated per backend and KV format
where a calibration exists, else the roofline). Also what the planner would pick at each context,
freely and where a choice is forced (a memory cap fp16 does not fit under, a speed target above its
own fp16 projection), for the goal that its pick is never slower on the bench than what it passed over."""
from __future__ import annotations

from dataclasses import dataclass

from localctx.backends.machine.detect import load_per_core, measure_copy_bandwidth
from localctx.backends.machine.planner_inputs import PlanningContext, make_auto_plan, planning_context
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError
from localctx.kvcache.planner import PlanRequest, budget
from localctx.kvcache.policy import FP16, KVPolicy
from localctx.kvcache.model_spec import ModelSpec

BASELINE_AS = "llamacpp"  # the planner projects plain llama.cpp as the llama.cpp backend with fp16 KV
SPEED_TARGET_OVER_FP16 = 1.05  # the forced speed target: this much above the planner's own fp16 projection


@dataclass(frozen=True)
class Projection:
    kv_bytes: int  # the cost model's bytes for the measured stream length
    roofline_decode_tok_s: float
    planner_decode_tok_s: float
    planner_basis: str


class Projector:
    """One planning context per backend (hardware detected once: bandwidth is measured and cached)."""

    def __init__(self, spec: ModelSpec, backends: list[str], hardware: str | None = None):
        self.spec = spec
        self.contexts: dict[str, PlanningContext] = {}
        for name in dict.fromkeys([*backends, BASELINE_AS]):
            self.contexts[name] = planning_context(name, spec, hardware)
        self.hardware = self.contexts[BASELINE_AS].hardware
        # the roofline uses bandwidth measured now, beside the measurements (the planner's figure may be cached
        # from another time); on a GPU the planner's figure (NVML or table) is the one that applies
        self.bandwidth_bytes_s, self.bandwidth_source = self.hardware.bandwidth_bytes_s, self.hardware.bandwidth_source
        if self.hardware.kind == "cpu" and hardware is None:
            load = load_per_core()
            self.bandwidth_bytes_s = measure_copy_bandwidth()
            self.bandwidth_source = ("measured at the start of this run (numpy copy, best of 6, one thread and all "
                                     f"cores; load {load:.1f} per core)")

    def _ctx(self, backend: str) -> PlanningContext:
        return self.contexts.get(backend) or self.contexts[BASELINE_AS]

    def bandwidth(self) -> dict:
        return {"bytes_s": self.bandwidth_bytes_s, "source": self.bandwidth_source,
                "planner_bytes_s": self.hardware.bandwidth_bytes_s, "planner_hardware": self.hardware.describe()}

    def project(self, backend: str, policy: KVPolicy, context: int, stream_tokens: int) -> Projection:
        speed = self._ctx(backend).speed
        kv_read = cost.kv_bytes(self.spec, policy, context)  # what attention reads per step at this context
        return Projection(
            kv_bytes=cost.kv_bytes(self.spec, policy, stream_tokens),
            roofline_decode_tok_s=cost.decode_tok_s_roofline(self.bandwidth_bytes_s, self.spec.decode_weight_bytes,
                                                             kv_read),
            planner_decode_tok_s=speed.worst_decode_tok_s(self.spec, policy, context),
            planner_basis=speed.basis(policy))

    def picks(self, backends: list[str], contexts: list[int]) -> list[dict]:
        """What the planner chooses for each backend at each context within the trained length."""
        out = []
        for name in backends:
            ctx = self.contexts[name]
            for context in (c for c in contexts if c <= self.spec.context_length):
                req = PlanRequest(context=context)
                fp16_fits = ctx.backend.kv_bytes(self.spec, FP16, context) <= budget(ctx.hardware, self.spec, req,
                                                                                  ctx.backend).kv
                out.append({"backend": name, "context": context, "policy": self._pick(ctx, req),
                            "fp16_fits": fp16_fits})
        return out

    def _pick(self, ctx: PlanningContext, req: PlanRequest) -> str:
        try:
            return str(make_auto_plan(ctx, self.spec, req).policy)
        except UserError as exc:
            return f"none ({exc})"

    def _cap_without_fp16(self, ctx: PlanningContext, context: int) -> int | None:
        """The largest --max-memory under which fp16's KV for ``context`` does not fit (None: it never fits)."""
        need = ctx.backend.kv_bytes(self.spec, FP16, context)

        def kv_room(cap: int) -> int:
            return budget(ctx.hardware, self.spec, PlanRequest(context=context, max_memory=cap), ctx.backend).kv

        lo, hi = 1, ctx.hardware.free_bytes
        if kv_room(hi) < need:
            return None
        while hi - lo > 1:  # kv_room grows with the cap: keep kv_room(lo) < need <= kv_room(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if kv_room(mid) < need else (lo, mid)
        return lo

    def forced_picks(self, backends: list[str], contexts: list[int], policies: list[str]) -> list[dict]:
        """What the planner chooses where fp16 is ruled out, per backend and context: under the largest
        memory cap fp16 does not fit ("memory": with the bench's ``policies`` that do fit), and under a
        decode target just above the planner's own fp16 projection ("speed")."""
        out = []
        for name in backends:
            ctx = self.contexts[name]
            for context in (c for c in contexts if c <= self.spec.context_length):
                cap = self._cap_without_fp16(ctx, context)
                if cap is not None:
                    req = PlanRequest(context=context, max_memory=cap)
                    room = budget(ctx.hardware, self.spec, req, ctx.backend).kv
                    fitting = [p for p in policies
                               if not ctx.backend.refusals(KVPolicy.parse(p))
                               and ctx.backend.kv_bytes(self.spec, KVPolicy.parse(p), context) <= room]
                    out.append({"backend": name, "context": context, "forced": "memory", "max_memory": cap,
                                "kv_budget": room, "fitting": fitting, "policy": self._pick(ctx, req)})
                target = ctx.speed.worst_decode_tok_s(self.spec, FP16, context) * SPEED_TARGET_OVER_FP16
                out.append({"backend": name, "context": context, "forced": "speed", "min_tok_s": round(target, 2),
                            "policy": self._pick(ctx, PlanRequest(context=context, min_tok_s=target))})
        return out
