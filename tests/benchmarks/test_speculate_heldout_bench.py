"""benchmarks/reuse/speculate_heldout.py --in-process on the bundled model: one session, sized as
`localctx run` sizes it, answers both sides; every answer starts from an empty cache, so asking the
same prompt again gives the same text, and prompt lookup gives plain decoding's."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "reuse" / "speculate_heldout.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("speculate_heldout", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_in_process_sides_share_one_sized_session_and_start_empty():
    bench = load_bench()
    here = bench.InProcess(None, 24, "int8")  # None: the bundled model
    try:
        plan = here.session.plan
        assert plan.allocated_context < plan.context  # the requests' tokens, not the trained 8K
        prompt = bench.PROMPTS["code-edit"]
        off = here.run_once(prompt, "off", 24)
        ngram = here.run_once(prompt, "ngram", 24)
        again = here.run_once(prompt, "off", 24)
        assert off["generated"] == 24 and off["text"] == again["text"] == ngram["text"]
        assert off["cached"] == ngram["cached"] == again["cached"] == 0  # each prefilled its whole prompt
        assert off["speculate"] == "off" and (ngram["speculate"] == "ngram" or ngram["speculate"].startswith("off ("))
        assert off["drafted"] == 0 and ngram["accepted"] <= ngram["drafted"]
    finally:
        here.session.close()
