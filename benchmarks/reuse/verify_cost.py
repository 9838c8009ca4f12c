"""What a T-token verify step costs against a one-token (plain) decode step, per backend, on the
bundled model: the ceiling prompt lookup can reach on this machine.

For each backend a session answers a ~400-token prompt (so the cache holds a realistic context),
then the speculative loop's own verifier (backends/llamacpp/speculate.py, backends/torch/speculate.py)
appends T tokens in one forward with logits at every position and rolls them back, T = 1 (the
plain step) and 2..9 (the pending token plus a draft of up to MAX_DRAFT = 8), interleaved over
``--rounds`` rounds so load drifts hit every T alike. A step's cost is its fastest timing over the
fastest plain step's (the speculative planner's rule, backends/generation/draft_policy.py). If every
drafted token were accepted a T-token step would yield T tokens, so ``ceiling`` = max over T of
T / cost(T) is the most prompt lookup can speed decoding up here; a task accepting fewer tokens
gets less.

    python benchmarks/reuse/verify_cost.py --json docs/results/reuse/benchmarks-verify-cost.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # bench_json
from bench_json import emit  # noqa: E402
from localctx.app.session_options import SessionRequest, open_session
from localctx.backends.base import GenerationParams
from localctx.backends.generation.speculation import MAX_DRAFT

PROMPT = ("Copy the following text exactly:\n\n"
          + "The history of the harbour town begins with a small settlement by the river, where fishers "
            "dried their nets on the stones and traded salt with the farms upstream. " * 12)


def verifier_for(session):
    """The verifier the session's speculative loop would use, on the cache as it stands."""
    if session.backend_name == "llamacpp":
        from localctx.backends.llamacpp.speculate import LlamaCppVerifier

        return LlamaCppVerifier(session.llm, session.plan.context, session._shift)
    from localctx.backends.torch.session import CONVERSATION
    from localctx.backends.torch.speculate import TorchVerifier

    return TorchVerifier(session.engine, CONVERSATION, session.history, session.plan.context)


def measure(backend: str, rounds: int, model: str | None = None) -> dict:
    with open_session(SessionRequest(model=model, backend=backend, prompt_cache=False)) as session:
        done = list(session.generate(PROMPT, GenerationParams(max_tokens=8)))[-1]
        verifier = verifier_for(session)
        tokens = list(range(1000, 1000 + MAX_DRAFT + 1))  # any ids: the cost does not depend on them
        lengths = list(range(1, MAX_DRAFT + 2))
        times: dict[int, list[float]] = {t: [] for t in lengths}
        for _ in range(2):  # warm-up
            verifier.step(tokens[:1])
            verifier.rollback(1)
        for _ in range(rounds):
            for t in lengths:
                started = time.perf_counter()
                verifier.step(tokens[:t])
                times[t].append(time.perf_counter() - started)
                verifier.rollback(t)
        close = getattr(verifier, "close", None)
        if close is not None:
            close()
        plain = min(times[1])
        cost = {t: min(v) / plain for t, v in times.items()}
        best = max(lengths, key=lambda t: t / cost[t])
        return {"backend": backend, "model": session.spec.name, "policy": str(session.plan.policy),
                "context_tokens": done.stats.prompt_tokens + done.stats.generated_tokens,
                "plain_step_ms_min": round(plain * 1000, 3),
                "plain_step_ms_median": round(statistics.median(times[1]) * 1000, 3),
                "step_cost_in_plain_steps": {str(t): round(c, 3) for t, c in cost.items()},
                "extra_per_drafted_token": {str(t): round((cost[t] - 1) / (t - 1), 3) for t in lengths if t > 1},
                "ceiling": round(best / cost[best], 3), "ceiling_at_step_tokens": best}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="a GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--backends", default="llamacpp,torch")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    load = os.getloadavg()
    rows = [measure(b, args.rounds, args.model) for b in args.backends.split(",")]
    result = {"command": "python benchmarks/reuse/verify_cost.py " + " ".join(sys.argv[1:]),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
              "load_average_start": [round(x, 2) for x in load],
              "load_average_end": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
