"""Quality of a KV policy on the llama.cpp backend: the tasks of backends/evaluation/tasks.py run through
llama.cpp's own KV cache, as a llama.cpp session holds it (backends/llamacpp/session.py):

- the policy's cache types (f16 / q8_0 / q4_0; quantized types with flash attention), n_ctx and
  compact or full sliding layers come from ``shift.settings_for_policy``;
- a sinks + window policy streams through the session's context shift (``ContextShift.make_room``,
  a chunk of the oldest non-sink tokens at a time); what llama.cpp cannot do is refused with the
  backend's reason;
- perplexity: the text is decoded ``chunk`` tokens per batch with logits for every position of
  the batch, and each next-token log-prob is scored against the cache as it stands;
- passkey and the long-context tasks (backends/evaluation/long_tasks.py): the prompt streams in
  ``chunk``-token batches, then greedy decoding, exact match.

KV bytes held are llama.cpp's row sizes for the tokens in its cache (``allocation.held_bytes``);
the allocation (cells padded to 256) is reported beside them."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from localctx.backends.evaluation import long_tasks
from localctx.backends.evaluation.divergence import Divergence, DivergenceMeter, compare
from localctx.backends.evaluation.long_tasks import TaskSuite
from localctx.backends.evaluation.tasks import (NeedleResult, NeedleTask, PerplexityResult, PerplexityTask, PolicyReport,
                                          needle_grid, passkey_cells, perplexity_result, text_tokens,
                                          with_baseline)
from localctx.backends.models.ref import ModelRef
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


def next_token_nll(logits: np.ndarray, targets: Sequence[int], rows: int = 16) -> list[float]:
    """−log softmax(logits[i])[targets[i]] per row, in float64, ``rows`` rows at a time (a 262K-token
    vocabulary makes a whole batch of float64 rows hundreds of MB)."""
    out: list[float] = []
    for a in range(0, len(targets), rows):
        block = logits[a:a + rows].astype(np.float64)
        top = block.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(block - top).sum(axis=1))
        out.extend((log_z - block[np.arange(len(block)), targets[a:a + rows]]).tolist())
    return out


class LlamaCppTokenizer:
    """llama.cpp's own tokenizer for the model (its vocabulary only, no weights): BOS as the GGUF
    asks, special tokens written in the text become their ids (as the torch tokenizer does)."""

    def __init__(self, ref: ModelRef):
        from llama_cpp import Llama

        from localctx.backends.llamacpp.session import load_failure_reason, quiet_stderr, set_llama_log

        log: list[str] = []
        try:
            with quiet_stderr(log):
                self.llm = Llama(model_path=str(ref.path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError):
            raise UserError(f"llama.cpp cannot read {ref.path.name}'s vocabulary ({load_failure_reason(log)}); "
                            "use a GGUF of an architecture this llama-cpp-python supports") from None
        finally:
            set_llama_log(False)

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def decode(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids, special=False).decode("utf-8", errors="replace")

    def close(self) -> None:
        self.llm.close()


class LlamaCppEvaluator:
    """Runs the tasks for one GGUF, a fresh llama.cpp session per policy."""

    def __init__(self, ref: ModelRef, threads: int | None = None):
        if ref.kind != "gguf":
            raise UserError(f"the llama.cpp backend loads GGUF files and {ref.name} is an HF folder; "
                            "use --backend torch or a .gguf file")
        from localctx.backends.models.spec_reader import read_spec

        self.ref = ref
        self.spec = read_spec(ref)
        self.threads = threads
        self.tokenizer = LlamaCppTokenizer(ref)

    def refuse(self, policy: KVPolicy) -> None:
        from localctx.backends.llamacpp.backend import LlamaCppBackend

        reasons = LlamaCppBackend().refusals(policy, self.spec)
        if reasons:
            raise UserError(f"llama.cpp cannot run --kv {policy}: {reasons[0]}")

    def session(self, policy: KVPolicy, context: int, threads: int | None = None):
        from localctx.backends.llamacpp.session import LlamaCppSession

        self.refuse(policy)
        return LlamaCppSession(self.ref, Plan.fixed("llamacpp", self.spec, policy, context),
                               threads=threads or self.threads)

    # -- decoding a batch ------------------------------------------------------------------------
    @staticmethod
    def _decode(session, batch: Sequence[int], rows: Sequence[int] | None = None) -> np.ndarray:
        """Evaluates ``batch`` after what the cache holds (shifting the window first when the policy
        has one); a copy of the logits of the batch positions ``rows`` (default: the last), as float32
        rows. llama.cpp computes the output layer only for those rows."""
        import llama_cpp

        llm = session.llm
        if session._shift:
            session._shift.make_room(len(batch))
        n_past = int(llm.n_tokens)
        if n_past + len(batch) > llm.n_ctx():
            raise RuntimeError(f"{n_past + len(batch)} tokens do not fit llama.cpp's context of {llm.n_ctx()}")
        rows = [len(batch) - 1] if rows is None else list(rows)
        llm._batch.set_batch(batch=list(batch), n_past=n_past, logits_all=False)
        flags = llm._batch.batch.logits
        for i in range(len(batch)):
            flags[i] = False
        for i in rows:
            flags[i] = True
        llm._ctx.decode(llm._batch)
        llm.input_ids[n_past:n_past + len(batch)] = batch
        llm.n_tokens = n_past + len(batch)
        if session._shift:
            session._shift.stream.extend(batch)
        # one sequence in one batch: llama.cpp keeps the outputs in batch order
        vocab = llm.n_vocab()
        return np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, i), shape=(vocab,))
                         for i in rows]) if rows else np.empty((0, vocab), np.float32)

    @staticmethod
    def _step(session, chunk: int) -> int:
        """Tokens per batch: ``chunk``, at most llama.cpp's batch, and for a window at most what one
        shift leaves room for (the backend's own step, ``ContextShift.feed``)."""
        step = min(chunk, session.llm.n_batch)
        s = session.settings
        if s.window is not None:
            step = min(step, max(1, s.n_ctx - s.sinks - 1))
        return step

    # -- perplexity and KL divergence, every policy in lockstep -----------------------------------
    def perplexity(self, session, ids: Sequence[int], task: PerplexityTask) -> PerplexityResult:
        return self.lockstep([session], ids, task, reference=False)[0][0]

    def lockstep(self, sessions: list, ids: Sequence[int], task: PerplexityTask, reference: bool = True,
                 on_chunk=None, workers: int = 1) -> list[tuple[PerplexityResult, Divergence | None]]:
        """The text streamed through every session a chunk at a time, each scored against its cache as
        it stands; with ``reference``, ``sessions[0]`` is the full-precision cache and every other
        session's next-token distribution is compared with its on the same positions
        (backends/evaluation/divergence.py). Only the predictions ``task`` scores get logits.

        ``workers`` sessions decode at once (llama.cpp releases the GIL; give each session one thread
        then: no thread barriers, which spin and stall on a busy machine), and the previous chunk is
        scored meanwhile. ``on_chunk(done, total)`` after each chunk."""
        from concurrent.futures import ThreadPoolExecutor

        started = time.perf_counter()
        tokens = list(ids)[:task.n_tokens]
        n = len(tokens)
        for session in sessions:
            session.reset()
        nll = [[0.0] * n for _ in sessions]  # nll[j][i]: -log p(token i | tokens < i) through session j
        meters = [DivergenceMeter() for _ in sessions[1:]]
        step = min(self._step(session, task.chunk) for session in sessions)

        def score(start: int, rows: list[int], outs: list[np.ndarray]) -> None:
            targets = [tokens[start + 1 + i] for i in rows]
            if reference:
                got = compare(outs[0], outs[1:], targets, meters)
            else:
                got = [next_token_nll(out, targets) for out in outs]
            for j, row in enumerate(got):
                for i, value in zip(rows, row):
                    nll[j][start + 1 + i] = float(value)

        pending = None
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for start in range(0, n - 1, step):
                end = min(start + step, n - 1)
                rows = [i for i in range(end - start) if task.scores(start + 1 + i)]
                # a batch whose predictions are all unscored still needs one row (llama.cpp's last)
                futures = [pool.submit(self._decode, session, tokens[start:end], rows or None)
                           for session in sessions]
                if pending:
                    score(*pending)
                outs = [f.result() for f in futures]
                pending = (start, rows, outs) if rows else None
                if on_chunk:
                    on_chunk(end, n - 1)
            if pending:
                score(*pending)
        seconds = time.perf_counter() - started
        out = []
        for j, session in enumerate(sessions):
            held, in_cache, _ = session.kv_state()
            divergence = meters[j - 1].result() if reference and j else None
            out.append((perplexity_result(nll[j], task, held, in_cache, seconds), divergence))
        return out

    # -- passkey retrieval ---------------------------------------------------------------------
    def needle(self, session, cells, task: NeedleTask) -> NeedleResult:
        return needle_grid(cells, lambda ids: self._greedy(session, ids, task.answer_tokens, task.chunk))

    def _greedy(self, session, ids: list[int], n_new: int, chunk: int) -> str:
        session.reset()
        step = self._step(session, chunk)
        for start in range(0, len(ids), step):
            logits = self._decode(session, ids[start:start + step])
        out = []
        for _ in range(n_new):
            tok = int(logits[0].argmax())
            out.append(tok)
            logits = self._decode(session, [tok])
        return self.tokenizer.decode(out)

    # -- one policy ------------------------------------------------------------------------------
    def settings(self, session) -> dict:
        s = session.settings
        return {"type_k": s.type_k, "type_v": s.type_v, "flash_attn": s.flash_attn, "n_ctx": s.n_ctx,
                "swa_full": s.swa_full, "shift_chunk": s.shift_chunk, "kv_alloc_bytes": s.cache().bytes(self.spec)}


def evaluate(evaluator: LlamaCppEvaluator, policies: Sequence[KVPolicy], ppl: PerplexityTask | None,
             needle: NeedleTask | None, progress=None, baseline: bool = True, on_chunk=None,
             suite: TaskSuite | None = None) -> list[PolicyReport]:
    """Each policy's report (the full-precision cache first with ``baseline``): perplexity and, beside
    the full-precision cache, KL divergence with every policy in lockstep; then the passkey grid and the
    long-context tasks (``suite``), one policy at a time."""
    ordered = with_baseline(policies, baseline)
    for policy in ordered:  # refuse before anything runs
        evaluator.refuse(policy)
    ids = text_tokens(evaluator.tokenizer, ppl.n_tokens) if ppl else []
    cells = list(passkey_cells(evaluator.tokenizer, needle)) if needle else []
    samples = list(long_tasks.samples(evaluator.tokenizer, suite)) if suite else []
    reports = [PolicyReport(str(policy), policy.exact) for policy in ordered]
    if ppl:
        from localctx.backends.llamacpp.session import default_threads

        sessions = []
        # several caches: one thread each, as many decoding at once as there are threads
        workers = min(len(ordered), evaluator.threads or default_threads())
        try:
            for policy, report in zip(ordered, reports):
                sessions.append(evaluator.session(policy, len(ids), threads=1 if len(ordered) > 1 else None))
                report.backend_settings = evaluator.settings(sessions[-1])
            results = evaluator.lockstep(sessions, ids, ppl, reference=baseline, on_chunk=on_chunk,
                                         workers=workers if len(ordered) > 1 else 1)
        finally:
            for session in sessions:
                session.close()
        for report, (result, divergence) in zip(reports, results):
            report.perplexity, report.divergence = result, divergence
    for policy, report in zip(ordered, reports):
        if needle or suite:
            context = max([len(c[3]) + needle.answer_tokens for c in cells]
                          + [len(s.ids) + s.answer_tokens for s in samples], default=16)
            session = evaluator.session(policy, context)
            try:
                report.backend_settings = report.backend_settings or evaluator.settings(session)
                if needle:
                    report.needle = evaluator.needle(session, cells, needle)
                if suite:
                    report.long_tasks = long_tasks.run(samples,
                                                       lambda p, n: evaluator._greedy(session, p, n, suite.chunk))
            finally:
                session.close()
        if progress:
            progress(report)
    return reports
