"""``localctx plan --calibrate-quality``: what every lossy KV format a backend offers costs the model at
hand (docs/quality.md "KL divergence"). Built-in text (pydoc_data.topics, no download) streams
through the full-precision cache and every format's cache in lockstep (backends/evaluation/
divergence.py); then the sliding window the planner would take for this model here, cut to half
the text and scored only past it, beside a second full-precision cache. The result is cached per
model file identity and backend (kvcache/quality_calibration.py); the planner's quality budget
reads the formats' figures from then on and quotes the window's beside a windowed plan.

This shared module picks the engine's evaluator by name, as backends/registry.py picks a backend."""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Callable

from localctx.backends.evaluation.tasks import PerplexityTask
from localctx.backends.models.ref import ModelRef
from localctx.kvcache.calibration import load_note
from localctx.kvcache.errors import UserError
from localctx.kvcache.model_spec import ModelSpec
from localctx.kvcache.planner import planned_window
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.quality import format_key
from localctx.kvcache.quality_calibration import QualityCalibration, identity

# llama.cpp: every format streams TOKENS tokens of text, one thread per cache and as many caches at once as
# there are threads, and every STRIDE-th prediction is scored (logits only there: the output layer is a
# quarter of a 0.5B model's work per token): 1,536 positions spread over 3,072 tokens, about 6 CPU minutes
# for a 0.5B Q4_K_M model on 2 cores (docs/quality.md "Calibration time").
# The torch evaluator computes every row anyway: TORCH_TOKENS tokens, each prediction scored (stride 1).
TOKENS = 3072
STRIDE = 2
TORCH_TOKENS = 2048
# MLX (off Metal: weights expanded to float32, every row's logits) streams MLX_TOKENS tokens through the
# full-precision cache and each of its three lossy formats, then two caches for the window: SmolLM2-135M at
# 512 tokens took 217 s wall on 2 cores, so 384 tokens project to about 10 minutes for a 0.5B model
# (docs/quality.md "Calibration time").
MLX_TOKENS = 384
CHUNK = 256  # tokens per forward
FORMATS = ("int8", "k8v4", "kf16v4", "int4+res128", "int4")  # those the backend does not refuse are measured


def progress_bar(out=None, width: int = 30) -> Callable[[int, int], None]:
    """``(done, total)`` → one redrawn line: a bar, tokens streamed, elapsed seconds. Without ``out`` it
    writes to whatever ``sys.stderr`` is when it draws (a default bound at import would keep a stream
    that a test runner or a caller has since closed)."""
    started = time.perf_counter()

    def show(done: int, total: int) -> None:
        stream = out if out is not None else sys.stderr
        filled = round(width * done / max(total, 1))
        stream.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done:,}/{total:,} tokens "
                     f"{time.perf_counter() - started:5.0f} s")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return show


def formats_for(backend: str, spec: ModelSpec) -> list[KVPolicy]:
    from localctx.backends import registry

    engine = registry.backend_class(backend)()
    return [p for p in map(KVPolicy.parse, FORMATS) if not engine.refusals(p, spec)]


def task_for(backend: str, tokens: int | None = None) -> PerplexityTask:
    if backend == "llamacpp":
        return PerplexityTask((tokens or TOKENS) + 1, CHUNK, stride=STRIDE)
    if backend == "mlx":
        return PerplexityTask((tokens or MLX_TOKENS) + 1, CHUNK)
    return PerplexityTask((tokens or TORCH_TOKENS) + 1, CHUNK)


def measured_words(task: PerplexityTask, spec: ModelSpec) -> str:
    """What a calibration measures, in words (printed before it runs and kept in its note)."""
    n = task.n_tokens - 1
    scored = len(range(1, n + 1, task.stride))
    every = f"every {task.stride}{'nd' if task.stride == 2 else 'th'} prediction" if task.stride > 1 else "every prediction"
    return (f"{n:,} tokens of built-in text (pydoc_data.topics), {every} scored: {scored:,} positions "
            f"from 1 to {n:,} of the {spec.context_length:,} trained")


def window_for(backend: str, spec: ModelSpec, ref: ModelRef, tokens: int | None = None) -> KVPolicy | None:
    """The windowed policy the planner takes for this model on this machine (kvcache/planner.py
    ``planned_window``), its window cut to half the calibration text so the other half is scored past it."""
    from localctx.backends.machine.planner_inputs import planning_context

    ctx = planning_context(backend, spec, model_file=ref.path)
    return planned_window(ctx.hardware, spec, ctx.backend, ctx.speed, task_for(backend, tokens).n_tokens - 1)


def window_task(task: PerplexityTask, window: KVPolicy) -> PerplexityTask:
    """The same text and stride, scored only at predictions made after the cache has evicted: from the
    first position past its sinks + window."""
    return replace(task, score_from=window.capacity() + 1)


def window_words(task: PerplexityTask, window: KVPolicy) -> str:
    wt = window_task(task, window)
    n = task.n_tokens - 1
    scored = len(range(wt.score_from, n + 1, task.stride))
    return (f"{window}, scored only past its {window.capacity():,} cached tokens: {scored:,} positions from "
            f"{wt.score_from:,} to {n:,}")


def evaluator_for(backend: str, ref: ModelRef, threads: int | None = None):
    """``run(policies, task, on_chunk)``: the engine's evaluator over the full-precision cache and
    ``policies`` in lockstep, the model loaded once."""
    if backend == "llamacpp":
        from localctx.backends.llamacpp.evaluate import LlamaCppEvaluator, evaluate

        engine = LlamaCppEvaluator(ref, threads=threads)
        return lambda policies, task, on_chunk: evaluate(engine, policies, task, None, on_chunk=on_chunk)
    if backend == "torch":
        from localctx.backends.torch.evaluate import PolicyEvaluator, evaluate
        from localctx.backends.torch.loading import TorchOptions, load_model

        loaded = load_model(ref, TorchOptions.from_env())
        engine = PolicyEvaluator(loaded.model, loaded.tokenizer)
        return lambda policies, task, on_chunk: evaluate(engine, policies, task, None, on_chunk=on_chunk)
    if backend == "mlx":  # each policy on the graph `localctx run` takes for it, the reference on theirs
        from localctx.backends.mlx.evaluate import MLXEvaluator, evaluate as mlx_evaluate

        mlx_engine = MLXEvaluator(ref, chunk=CHUNK, graph="auto")
        return lambda policies, task, on_chunk: mlx_evaluate(mlx_engine, policies, task, None, on_chunk=on_chunk)
    raise UserError(f"--calibrate-quality measures the llamacpp, torch or mlx backend, not {backend}; "
                    "add --backend llamacpp, --backend torch or --backend mlx")


def _numbers(d) -> dict:
    return {"mean_kld": d.mean_kld, "p99_kld": d.p99_kld, "top1": d.top1, "ppl_delta_pct": d.ppl_delta_pct,
            "tokens": d.scored}


def calibrate(backend: str, ref: ModelRef, spec: ModelSpec, window: KVPolicy | None, tokens: int | None = None,
              on_chunk=None, threads: int | None = None) -> QualityCalibration:
    """Every lossy format ``backend`` offers, in one lockstep pass; then ``window`` (``window_for``) beside
    a second full-precision cache, scored only past its window (``window_task``)."""
    if ref.kind not in ("gguf", "hf"):
        raise UserError(f"--calibrate-quality measures a local model file; {ref.name} is not one")
    policies = formats_for(backend, spec)
    if not policies:
        raise UserError(f"the {backend} backend offers no lossy KV format for {spec.name}: nothing to calibrate")
    started = time.perf_counter()
    ident = identity(ref.path)  # before the run: a file replaced meanwhile does not get this result
    task = task_for(backend, tokens)
    run = evaluator_for(backend, ref, threads)
    passes = 2 if window else 1
    show = on_chunk or (lambda done, total: None)
    reports = run(policies, task, lambda done, total: show(done, passes * total))
    figures = {format_key(KVPolicy.parse(r.policy)): _numbers(r.divergence) for r in reports[1:]}
    windows, words = {}, f"{measured_words(task, spec)}, per format"
    if window:
        wtask = window_task(task, window)
        _, measured = run([window], wtask, lambda done, total: show(total + done, 2 * total))
        windows[str(window)] = _numbers(measured.divergence) | {"score_from": wtask.score_from}
        words += f"; the window {window_words(task, window)}"
    wall = time.perf_counter() - started
    return QualityCalibration(
        backend, ident, figures,
        command=f"localctx plan --calibrate-quality -m {ref.path} --backend {backend}",
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        note=f"{words}; in {wall:.0f} s; {load_note()}",
        extra={"model_name": spec.name, "head_dim": spec.head_dim, "n_params": spec.n_params,
               "reference_ppl": reports[0].perplexity.ppl, "wall_s": round(wall, 1)},
        windows=windows)
