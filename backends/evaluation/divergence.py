"""How far a KV policy moves the model's next-token distribution from the full-precision cache's
(docs/quality.md "KL divergence"), shared by every backend's evaluator.

Both caches see the same tokens in lockstep, chunk by chunk; for every scored position the
evaluator hands the two rows of logits here. Per position, in float64:

- KL(full || policy) = Σ_v p(v) (log p(v) − log q(v)), p the full-precision cache's softmax, q the policy's;
- top-1 agreement: the two argmaxes are the same token;
- the policy's −log q(next token), for its perplexity beside.

A policy's result is the mean and the 99th percentile of KL over the positions, the agreement
rate and the perplexity. KL = 0 exactly when the rows are equal; perplexity alone hides a policy
that moves probability between wrong tokens, and a mean hides a few collapsed positions (p99)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

ROWS = 16  # rows per block: a 262K-token vocabulary makes a float64 row 2 MB


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of log-probabilities in float64."""
    block = np.asarray(logits, dtype=np.float64)
    top = block.max(axis=1, keepdims=True)
    shifted = block - top
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def kl_rows(ref_logp: np.ndarray, logp: np.ndarray, ref_p: np.ndarray | None = None) -> np.ndarray:
    """KL(p || q) per row from log-probabilities (never negative: rounding below zero is clipped);
    ``ref_p`` = exp(ref_logp) where the caller has it already (one per block for every policy)."""
    ref_p = np.exp(ref_logp) if ref_p is None else ref_p
    return np.maximum((ref_p * (ref_logp - logp)).sum(axis=1), 0.0)


@dataclass(frozen=True)
class Divergence:
    """One policy against the full-precision cache over the same scored positions."""
    mean_kld: float  # nats per position
    p99_kld: float
    max_kld: float
    top1: float  # fraction of positions whose argmax agrees with the full-precision cache's
    ppl: float  # the policy's perplexity over the same positions
    ref_ppl: float  # the full-precision cache's
    scored: int

    @property
    def ppl_delta_pct(self) -> float:
        return (self.ppl / self.ref_ppl - 1) * 100


@dataclass
class DivergenceMeter:
    """Accumulates one policy's per-position KL, agreement and negative log-likelihood, and the
    full-precision cache's negative log-likelihood on the same positions."""
    kld: list = field(default_factory=list)
    agree: int = 0
    nll: list = field(default_factory=list)
    ref_nll: list = field(default_factory=list)

    def add(self, ref_logp: np.ndarray, logp: np.ndarray, targets: np.ndarray,
            ref_p: np.ndarray | None = None) -> None:
        rows = np.arange(len(targets))
        self.kld.extend(kl_rows(ref_logp, logp, ref_p).tolist())
        self.agree += int((ref_logp.argmax(axis=1) == logp.argmax(axis=1)).sum())
        self.nll.extend((-logp[rows, targets]).tolist())
        self.ref_nll.extend((-ref_logp[rows, targets]).tolist())

    def result(self) -> Divergence | None:
        n = len(self.kld)
        if not n:
            return None
        kld = np.asarray(self.kld)
        return Divergence(float(kld.mean()), float(np.percentile(kld, 99)), float(kld.max()), self.agree / n,
                          math.exp(math.fsum(self.nll) / n), math.exp(math.fsum(self.ref_nll) / n), n)


def compare(ref_logits: np.ndarray, logits: Sequence[np.ndarray], targets: Sequence[int],
            meters: Sequence[DivergenceMeter], first: int = 0, rows: int = ROWS) -> list[np.ndarray]:
    """One chunk: ``ref_logits[i]`` (the full-precision cache) and each ``logits[j][i]`` predict
    ``targets[i]``. Rows from ``first`` on go into ``meters[j]``; the full-precision rows become
    log-probabilities once per block for every policy. Returns −log p(target) per row, the
    full-precision cache's first, then each policy's (the perplexity of every row, scored or not)."""
    targets = np.asarray(targets, dtype=np.int64)
    n = len(targets)
    nll = [np.empty(n) for _ in range(len(logits) + 1)]
    for a in range(0, n, rows):
        b = min(n, a + rows)
        t, idx, keep = targets[a:b], np.arange(b - a), slice(max(0, first - a), None)
        ref_logp = log_softmax(ref_logits[a:b])
        ref_p = np.exp(ref_logp[keep]) if meters and b > first else None
        nll[0][a:b] = -ref_logp[idx, t]
        for j, (policy_logits, meter) in enumerate(zip(logits, meters)):
            logp = log_softmax(policy_logits[a:b])
            nll[j + 1][a:b] = -logp[idx, t]
            if b > first:
                meter.add(ref_logp[keep], logp[keep], t[keep], ref_p)
    return nll
