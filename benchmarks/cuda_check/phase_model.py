"""Phase 3 of benchmarks/cuda_check/one_run.py: the torch backend decoding a Llama-3.1-8B-shaped model
(random weights, generated on the device one tensor at a time; no file) at each context and KV
policy, and the planner's projection for the same GPU beside what was measured.

The cache is filled as a chunked prefill leaves it — random K/V appended chunk by chunk through
the cache's own ``attend`` seam (so quantization, eviction and the block pool run as in a real
prefill), with the cache's attention swapped for a no-op while filling: decode speed depends on
the shapes and the policy, not on the values, and a 128K-token prefill would take most of the time
budget. Then decode steps run through ``Engine.decode`` with the real attention (the Triton
kernels on CUDA) and are timed one by one (each step ends with the argmax, as sampling does)."""
from __future__ import annotations

import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Mapping

import torch

from common import ModelSizes, PhaseClock, synchronize
from localctx.backends.machine.detect import nvidia_profile
from localctx.backends.torch.config import LlamaConfig
from localctx.backends.torch.engine import Engine
from localctx.backends.torch.llama import LlamaModel
from localctx.backends.torch.rope import RopeScaling
from localctx.kernels_cuda import dispatch
from localctx.kvcache import cost
from localctx.kvcache.errors import UserError
from localctx.kvcache.factory import CacheKernels, CacheRequest, make_kv_cache
from localctx.kvcache.hardware_profile import HardwareProfile
from localctx.kvcache.paged import PagedKVCache
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.quant_attention import AttentionResult
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.speed import SpeedModel

PREFILL_CHUNK = 512  # the engine's default chunk: a windowed cache's pool holds one more chunk


def llama_config(smoke: bool) -> LlamaConfig:
    """Llama-3.1-8B (assets/models.json "llama-3.1-8b"), or a tiny Llama of the same structure."""
    if smoke:
        return LlamaConfig("llama", n_layers=1, hidden_size=256, n_heads=4, n_kv_heads=1, head_dim=64,
                           intermediate_size=512, vocab_size=1024, context_length=4096, rope_base=500000.0)
    return LlamaConfig("llama", n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                       intermediate_size=14336, vocab_size=128256, context_length=131072, rope_base=500000.0,
                       rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))


class RandomWeights(Mapping):
    """GGUF-named tensors in the HF layout, each generated on the device when the model asks for it
    (N(0, 1/fan_in) matrices, unit norms), so only the model's own fused copies stay resident."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device, seed: int = 0):
        self.dtype, self.device = dtype, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        c = cfg
        shapes = {"token_embd.weight": (c.vocab_size, c.hidden_size), "output_norm.weight": (c.hidden_size,),
                  "output.weight": (c.vocab_size, c.hidden_size)}
        for i in range(c.n_layers):
            p = f"blk.{i}."
            shapes.update({p + "attn_norm.weight": (c.hidden_size,), p + "ffn_norm.weight": (c.hidden_size,),
                           p + "attn_q.weight": (c.q_size, c.hidden_size), p + "attn_k.weight": (c.kv_size, c.hidden_size),
                           p + "attn_v.weight": (c.kv_size, c.hidden_size),
                           p + "attn_output.weight": (c.hidden_size, c.q_size),
                           p + "ffn_gate.weight": (c.intermediate_size, c.hidden_size),
                           p + "ffn_up.weight": (c.intermediate_size, c.hidden_size),
                           p + "ffn_down.weight": (c.hidden_size, c.intermediate_size)})
        self.shapes = shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        w = torch.empty(shape, dtype=self.dtype, device=self.device)
        return w.normal_(0.0, 1.0 / math.sqrt(shape[1]), generator=self.gen)

    def __contains__(self, name) -> bool:  # without generating the tensor
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())


def model_spec(cfg: LlamaConfig, model: LlamaModel, n_params: int, dtype: torch.dtype) -> ModelSpec:
    return ModelSpec(name="Llama-3.1-8B shape, random weights" if cfg.n_layers == 32 else "tiny Llama, random weights",
                     architecture="llama", n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                     head_dim=cfg.head_dim, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                     context_length=cfg.context_length, rope_base=cfg.rope_base, weight_bytes=model.weight_bytes(),
                     n_params=n_params, kv_elem_bytes=torch.empty((), dtype=dtype).element_size(),
                     intermediate_size=cfg.intermediate_size)


def make_cache(model: LlamaModel, policy: KVPolicy, tokens: int, dtype: torch.dtype, device: torch.device):
    """The cache ``backends/torch/loading.build_session`` builds (that module also loads GGUF files
    and tokenizers, which this script must not import): same request, same kernels."""
    c = model.config
    if policy.capacity() is not None:
        tokens = max(tokens, policy.capacity() + policy.group_size + PREFILL_CHUNK)
    dev = device.type
    req = CacheRequest(c.n_layers, c.n_kv_heads, c.head_dim, capacity_tokens=tokens, dtype=dtype, device=dev)
    kernels = CacheKernels(paged_attention=dispatch.paged_attention(dev), policy_attention=dispatch.policy_attention(dev),
                           quantize_groups=dispatch.quantize_groups(dev) if dispatch.uses_kernels(dev) else None)
    return make_kv_cache(policy, req, model.make_rope(), kernels)


def fill(cache, cfg: LlamaConfig, n_tokens: int, chunk: int, dtype: torch.dtype, device: torch.device) -> None:
    """Sequence 0 holds what ``n_tokens`` of prefill leave in it (random K/V, see the module doc)."""
    real = cache.attention
    cache.attention = _no_attention_paged if isinstance(cache, PagedKVCache) else _no_attention_policy
    gen = torch.Generator(device=device).manual_seed(n_tokens)
    try:
        cache.add_sequence(0, reserve_tokens=n_tokens)
        with torch.inference_mode():
            for start in range(0, n_tokens, chunk):
                T = min(chunk, n_tokens - start)
                q = torch.zeros(1, T, cfg.n_heads, cfg.head_dim, dtype=dtype, device=device)
                cache.begin_step([0], T)
                for layer in range(cfg.n_layers):
                    k = torch.randn(1, T, cfg.n_kv_heads, cfg.head_dim, generator=gen, dtype=dtype, device=device)
                    v = torch.randn(1, T, cfg.n_kv_heads, cfg.head_dim, generator=gen, dtype=dtype, device=device)
                    cache.attend(layer, q, k, v)
                cache.end_step()
    finally:
        cache.attention = real


def _no_attention_paged(q, *args, **kwargs):
    return q


def _no_attention_policy(q, *args, **kwargs):
    return AttentionResult(q)


def decode_steps(engine: Engine, steps: int, warmup: int, device: torch.device) -> dict:
    token, walls, gpu = 1, [], []
    for i in range(warmup + steps):
        synchronize(device)
        t = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        logits = engine.decode([0], [token])
        if device.type == "cuda":
            end.record()
        token = int(logits[0].argmax())  # waits for the step, as sampling does
        wall = (time.perf_counter() - t) * 1e3
        if i >= warmup:
            walls.append(wall)
            if device.type == "cuda":
                gpu.append(start.elapsed_time(end))
    return {"step_ms": statistics.median(walls), "event_ms": statistics.median(gpu) if gpu else None,
            "steps": steps, "warmup": warmup}


def profiles(copy_gbs: float, device: torch.device) -> dict[str, HardwareProfile]:
    """The GPU as the planner would see it (assets/hardware.json, vendor peak × achievable
    fraction) and as a named profile from the bandwidth measured in this run."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
        measured = HardwareProfile(kind="cuda", name=f"{name} (measured copy)", memory_bytes=total, free_bytes=free,
                                   bandwidth_bytes_s=copy_gbs * 1e9, bandwidth_source="measured", key="measured")
        try:
            table = nvidia_profile(name, total, free)
        except UserError:  # not in assets/hardware.json: only the measured profile
            return {"measured": measured}
        return {"table": table, "measured": dataclasses.replace(table, name=measured.name, key=f"{table.key}-measured",
                                                                bandwidth_bytes_s=measured.bandwidth_bytes_s,
                                                                bandwidth_source="measured")}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"measured": HardwareProfile(kind="cpu", name="this CPU (measured copy)", memory_bytes=total,
                                        free_bytes=total, bandwidth_bytes_s=copy_gbs * 1e9,
                                        bandwidth_source="measured", key="smoke-measured")}


def run(s: ModelSizes, clock: PhaseClock, copy_gbs: float, device: torch.device, smoke: bool) -> dict:
    cfg = llama_config(smoke)
    t0 = time.monotonic()
    weights = RandomWeights(cfg, s.dtype, device)
    model = LlamaModel(cfg, weights, dtype=s.dtype, device=str(device))
    synchronize(device)
    spec = model_spec(cfg, model, weights.n_params(), s.dtype)
    hw = profiles(copy_gbs, device)
    head = {"model": dataclasses.asdict(cfg),
            "dtype": str(s.dtype).replace("torch.", ""), "weight_bytes": spec.weight_bytes, "n_params": spec.n_params,
            "build_seconds": time.monotonic() - t0, "kernels": dispatch.uses_kernels(device.type),
            "dispatch_mode": dispatch.mode(), "copy_gbs": copy_gbs,
            "profiles": {k: p.to_dict() for k, p in hw.items()}}
    rows, skipped, errors = [], [], []
    for context in s.contexts:
        for text in s.policies:
            if not clock.allows(25.0 if device.type == "cuda" else 1.0):
                skipped.append({"context": context, "policy": text, "reason": "time budget"})
                continue
            try:
                rows.append(case(model, spec, KVPolicy.parse(text), context, s, copy_gbs, hw, device))
            except Exception as exc:
                errors.append({"context": context, "policy": text, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    status = "ok" if rows and not errors else "failed"
    if not rows and not errors and skipped:
        status = "skipped"  # no time was left for any case
    return {"status": status, **head, "rows": rows, "errors": errors, "skipped": skipped, "goals": goals(rows)}


def case(model: LlamaModel, spec: ModelSpec, policy: KVPolicy, context: int, s: ModelSizes, copy_gbs: float,
         hw: dict[str, HardwareProfile], device: torch.device) -> dict:
    t0 = time.monotonic()
    cache = make_cache(model, policy, context + s.warmup + s.steps + 64, s.dtype, device)
    fill(cache, model.config, context, s.fill_chunk, s.dtype, device)
    filled = time.monotonic() - t0
    engine = Engine(model, cache)
    kv_held = cache.kv_bytes(0)
    timing = decode_steps(engine, s.steps, s.warmup, device)
    tok_s = 1e3 / timing["step_ms"]
    kv = cost.kv_bytes(spec, policy, context)
    step_bytes = spec.weight_bytes + kv
    row = {"context": context, "policy": str(policy), "cache": type(cache).__name__, **timing, "tok_s": tok_s,
           "weight_bytes": spec.weight_bytes, "kv_bytes_cost_model": kv, "kv_bytes_cache": kv_held,
           "bytes_per_step": step_bytes, "achieved_gbs": step_bytes * tok_s / 1e9,
           "copy_fraction": step_bytes * tok_s / (copy_gbs * 1e9), "fill_seconds": filled,
           "case_seconds": time.monotonic() - t0}
    for name, profile in hw.items():
        speed = SpeedModel(profile)
        projected = speed.worst_decode_tok_s(spec, policy, context)
        row[f"planner_{name}"] = {"tok_s": projected, "measured_over_projected": tok_s / projected,
                                  "basis": speed.basis(policy)}
    del engine, cache
    return row


def goals(rows: list[dict]) -> dict:
    """Issue 24's goals: decode at 32K ≥ 70% of the measured bandwidth; the planner's projection
    from the measured profile within ±25% of the measured tok/s."""
    at_32k = [{"policy": r["policy"], "copy_fraction": r["copy_fraction"]} for r in rows if r["context"] == 32768]
    ratios = [{"context": r["context"], "policy": r["policy"], "ratio": r["planner_measured"]["measured_over_projected"]}
              for r in rows]
    return {"bandwidth_at_32k": {"target": 0.70, "rows": at_32k,
                                 "met": bool(at_32k) and all(x["copy_fraction"] >= 0.70 for x in at_32k)},
            "planner_within_25pct": {"rows": ratios,
                                     "met": bool(ratios) and all(0.75 <= x["ratio"] <= 1.25 for x in ratios)}}
