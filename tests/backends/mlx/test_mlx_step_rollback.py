"""The MLX caches after a step that fails part way through the layers: every layer is back to its
state before the step, and what follows matches a session that never failed."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'mlx[cpu]' on Linux)")

from localctx.backends.mlx.full_rows import FullRows  # noqa: E402
from localctx.kernels_metal.quant_append import QuantStore  # noqa: E402
from test_mlx_backend import tiny_session, tiny_folder  # noqa: E402,F401  (tiny_folder is a fixture)


class InjectedFailure(RuntimeError):
    pass


def layer_state(layer) -> list:
    out = []
    for part in layer.snapshot():
        if isinstance(part, FullRows):  # the held rows (the buffers' spare rows are no state)
            arrays = [part.keys(), part.values()]
        else:
            arrays = part.arrays() if isinstance(part, QuantStore) else [part]
        out += [np.array(a) if isinstance(a, (mx.array, np.ndarray)) else a for a in arrays]
    return out


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("kv,graph,method", [
    ("fp16+sink2+win12", "page", "attend"), ("int8+sink2+win40+heavy4", "page", "attend"),
    ("int4+res8", "page", "attend"), ("int4+res8", "mlx-lm", "update_and_fetch"),
    ("int8+sink2+win12", "mlx-lm", "update_and_fetch")])
def test_a_step_failing_in_any_layer_leaves_no_trace(tiny_folder, kv, graph, method, monkeypatch):
    failing, _ = tiny_session(tiny_folder, kv, graph=graph)
    clean, _ = tiny_session(tiny_folder, kv, graph=graph)
    prompt = failing.tokenizer.encode("the cache keeps sinks and a window of recent tokens " * 2)
    logits = [s.feed(prompt) for s in (failing, clean)]
    n_layers = len(failing.cache.layers)
    for step in range(40):
        tok = int(np.argmax(logits[1]))
        before = [layer_state(layer) for layer in failing.cache.layers]
        bad = failing.cache.layers[step % n_layers]
        real = getattr(bad, method)

        def attend_then_fail(*args, real=real):
            real(*args)
            raise InjectedFailure("out of memory")
        with monkeypatch.context() as m:
            m.setattr(bad, method, attend_then_fail)
            with pytest.raises(InjectedFailure):
                failing.feed([tok])
        assert all(same(layer_state(layer), b) for layer, b in zip(failing.cache.layers, before))
        assert len({layer.n_seen for layer in failing.cache.layers}) == 1
        assert failing.last_logits is None and failing.fed == clean.fed
        logits = [s.feed([tok]) for s in (failing, clean)]
        assert np.array_equal(logits[0], logits[1]), f"step {step}"
