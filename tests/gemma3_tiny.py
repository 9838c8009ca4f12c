"""A tiny random-weight Gemma 3 for tests (GGUF tensor names, norms stored as 1 + weight the way
llama.cpp's converter writes them) and an independent numpy forward of the same math: every layer
over the whole prompt with explicit masks, no cache."""
from __future__ import annotations

import numpy as np

N_LAYERS, HIDDEN, N_HEADS, N_KV, HEAD_DIM, FFN, VOCAB = 6, 32, 2, 1, 32, 48, 64
WINDOW = 4  # layers 0-4 slide over the last 4 tokens, layer 5 is global
LOCAL_BASE, GLOBAL_BASE, EPS = 10000.0, 1_000_000.0, 1e-6
QUERY_SCALE = 12.0 ** -0.5  # deliberately not head_dim ** -0.5: the page must apply its own


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": (0.5 * rng.standard_normal((VOCAB, HIDDEN))).astype(np.float32),
         "output_norm.weight": norm(HIDDEN)}
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        t.update({
            p + "attn_norm.weight": norm(HIDDEN), p + "attn_q.weight": mat(N_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_k.weight": mat(N_KV * HEAD_DIM, HIDDEN), p + "attn_v.weight": mat(N_KV * HEAD_DIM, HIDDEN),
            p + "attn_q_norm.weight": norm(HEAD_DIM), p + "attn_k_norm.weight": norm(HEAD_DIM),
            p + "attn_output.weight": mat(HIDDEN, N_HEADS * HEAD_DIM), p + "post_attention_norm.weight": norm(HIDDEN),
            p + "ffn_norm.weight": norm(HIDDEN), p + "ffn_gate.weight": mat(FFN, HIDDEN),
            p + "ffn_up.weight": mat(FFN, HIDDEN), p + "ffn_down.weight": mat(HIDDEN, FFN),
            p + "post_ffw_norm.weight": norm(HIDDEN)})
    return t


def layer_windows() -> tuple[int | None, ...]:
    return tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(N_LAYERS))


def _norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    """x [T, H, D], rotating halves (i, i + D/2) at positions 0..T-1."""
    t, _, d = x.shape
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_logits(w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """[T, vocab] float64 logits of every position."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    T = len(tokens)
    x = w["token_embd.weight"][tokens] * np.sqrt(HIDDEN)
    q_pos, k_pos = np.arange(T)[:, None], np.arange(T)[None, :]
    for i, window in enumerate(layer_windows()):
        p = f"blk.{i}."
        visible = k_pos <= q_pos
        if window is not None:
            visible &= q_pos - k_pos < window
        base = GLOBAL_BASE if window is None else LOCAL_BASE
        h = _norm(x, w[p + "attn_norm.weight"])
        q = _norm((h @ w[p + "attn_q.weight"].T).reshape(T, N_HEADS, HEAD_DIM), w[p + "attn_q_norm.weight"])
        k = _norm((h @ w[p + "attn_k.weight"].T).reshape(T, N_KV, HEAD_DIM), w[p + "attn_k_norm.weight"])
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, N_KV, HEAD_DIM)
        q, k = _rope(q, base), _rope(k, base)
        k, v = np.repeat(k, N_HEADS // N_KV, axis=1), np.repeat(v, N_HEADS // N_KV, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) * QUERY_SCALE
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", probs, v).reshape(T, N_HEADS * HEAD_DIM)
        x = x + _norm(o @ w[p + "attn_output.weight"].T, w[p + "post_attention_norm.weight"])
        h = _norm(x, w[p + "ffn_norm.weight"])
        mlp = (_gelu_tanh(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        x = x + _norm(mlp, w[p + "post_ffw_norm.weight"])
    return _norm(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


def torch_model(tensors: dict[str, np.ndarray]):
    import torch

    from localctx.backends.torch.gemma3 import Gemma3Config, Gemma3Model

    config = Gemma3Config(architecture="gemma3", n_layers=N_LAYERS, hidden_size=HIDDEN, n_heads=N_HEADS,
                          n_kv_heads=N_KV, head_dim=HEAD_DIM, intermediate_size=FFN, vocab_size=VOCAB,
                          context_length=1024, layer_windows=layer_windows(), query_scale=QUERY_SCALE,
                          norm_eps=EPS, rope_base=GLOBAL_BASE, local_rope_base=LOCAL_BASE)
    return Gemma3Model(config, {k: torch.from_numpy(v) for k, v in tensors.items()})


def mlx_model(tensors: dict[str, np.ndarray]):
    import mlx.core as mx

    from localctx.backends.mlx import gemma3

    args = gemma3.ModelArgs(hidden_size=HIDDEN, n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV,
                            head_dim=HEAD_DIM, intermediate_size=FFN, vocab_size=VOCAB,
                            layer_windows=layer_windows(), query_scale=QUERY_SCALE, rms_eps=EPS,
                            rope_base=GLOBAL_BASE, local_rope_base=LOCAL_BASE)
    weights = {gemma3._gguf_name(k): mx.array(v) for k, v in tensors.items()}
    return gemma3.build(args, weights, mx.float32)
