"""The MLX session's pipelined greedy loop (session._greedy): the tokens of plain step-by-step
greedy decoding, and a cache that ends where ``fed`` does when the stream stops early."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX model zoo needs mlx-lm (pip install 'mlx-lm[cpu]' on Linux)")

from localctx.backends.base import GenerationParams  # noqa: E402
from test_mlx_backend import tiny_folder, tiny_session  # noqa: E402,F401  (tiny_folder is a fixture)

PROMPT = "the cache keeps sinks and a window of recent tokens " * 2


def stepwise(session, ids, n):
    """Greedy by feeding one token at a time: (tokens, logits after each token fed)."""
    logits, out, seen = session.feed(ids), [], []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = session.feed([out[-1]])
        seen.append(logits)
    return out, seen


@pytest.mark.parametrize("kv,graph", [("fp16", "mlx-lm"), ("int4+g32", "mlx-lm"), ("int8+g32+sink2+win40", "mlx-lm"),
                                      ("int4+g32+res8", "page")])
def test_pipelined_greedy_gives_stepwise_tokens_and_cache(tiny_folder, kv, graph):  # noqa: F811
    session, _ = tiny_session(tiny_folder, kv, graph=graph)
    ids = session.tokenizer.encode(PROMPT)
    got = [e.token for e in session.generate(PROMPT, GenerationParams(max_tokens=40, ignore_eos=True, speculate="off"))
           if e.kind == "token"]
    plain, _ = tiny_session(tiny_folder, kv, graph=graph)
    want, seen = stepwise(plain, ids, 40)
    assert got == want
    # the last token is not fed (as after feed-by-feed decoding), and the cache holds the rest
    assert session.fed == ids + want[:-1] and session.cache.n_seen == len(session.fed)
    np.testing.assert_allclose(session.last_logits, seen[-2], atol=1e-5)
    plain.reset()
    plain.feed(ids + want[:-1])
    assert session.cache.nbytes() == plain.cache.nbytes()


@pytest.mark.parametrize("kv", ["fp16", "int4+g32"])
def test_a_stream_stopped_early_undoes_the_step_queued_for_its_last_token(tiny_folder, kv):  # noqa: F811
    session, _ = tiny_session(tiny_folder, kv, graph="mlx-lm")
    ids = session.tokenizer.encode(PROMPT)
    events = session.generate(PROMPT, GenerationParams(max_tokens=40, ignore_eos=True, speculate="off"))
    taken = [next(events).token for _ in range(33)]  # the step feeding the 33rd token is in flight
    events.close()
    assert session.fed == ids + taken[:-1] and session.cache.n_seen == len(session.fed)
    assert int(np.argmax(session.last_logits)) == taken[-1]
    plain, _ = tiny_session(tiny_folder, kv, graph="mlx-lm")
    plain.feed(ids + taken[:-1])
    assert session.cache.nbytes() == plain.cache.nbytes()
    # the next turn reuses the whole cache and continues as the stepwise session does
    np.testing.assert_allclose(session.feed([taken[-1]]), plain.feed([taken[-1]]), atol=1e-5)
