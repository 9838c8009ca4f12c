"""An independent reference for the llama.cpp backend: the GGUF dequantised with the `gguf`
package and run through a plain numpy forward pass (fp32, no cache).

llama.cpp stores Q/K rows permuted for its interleaved ("normal") RoPE, so applying interleaved
RoPE to the stored weights reproduces the model exactly."""
from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class NumpyLlama:
    def __init__(self, path: str):
        reader = GGUFReader(path)
        f = lambda k: reader.fields[k].contents()  # noqa: E731
        self.n_layers = int(f("llama.block_count"))
        self.n_heads = int(f("llama.attention.head_count"))
        self.n_kv = int(f("llama.attention.head_count_kv"))
        self.dim = int(f("llama.embedding_length"))
        self.head_dim = self.dim // self.n_heads
        self.eps = float(f("llama.attention.layer_norm_rms_epsilon"))
        self.base = float(f("llama.rope.freq_base"))
        self.w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def _rope(self, x: np.ndarray) -> np.ndarray:  # x: [T, H, D], interleaved pairs
        t, _, d = x.shape
        inv = self.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = np.arange(t)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits of the token after the last one."""
        w, T, hd = self.w, len(tokens), self.head_dim
        x = w["token_embd.weight"][tokens]
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
        group = self.n_heads // self.n_kv
        for i in range(self.n_layers):
            p = f"blk.{i}."
            h = self._norm(x, w[p + "attn_norm.weight"])
            q = self._rope((h @ w[p + "attn_q.weight"].T).reshape(T, self.n_heads, hd))
            k = self._rope((h @ w[p + "attn_k.weight"].T).reshape(T, self.n_kv, hd))
            v = (h @ w[p + "attn_v.weight"].T).reshape(T, self.n_kv, hd)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            att = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", att, v).reshape(T, self.dim)
            x = x + o @ w[p + "attn_output.weight"].T
            h = self._norm(x, w[p + "ffn_norm.weight"])
            gate = h @ w[p + "ffn_gate.weight"].T
            up = h @ w[p + "ffn_up.weight"].T
            x = x + ((gate / (1 + np.exp(-gate))) * up) @ w[p + "ffn_down.weight"].T
        x = self._norm(x[-1], w["output_norm.weight"])
        head = w.get("output.weight", w["token_embd.weight"])
        return head @ x
