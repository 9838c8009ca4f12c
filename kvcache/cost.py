"""The cost model: the KV-byte and roofline arithmetic that the planner and every UI share.

A cache's reported bytes must equal ``kv_bytes`` for the same policy and token count."""
from __future__ import annotations

from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.spec import ModelSpec

SCALE_BYTES = 2  # each quantization group stores a scale and a min, fp16 each


def kv_elements_per_token(spec: ModelSpec) -> int:
    """K and V elements one token adds across all layers."""
    return 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim


def full_bytes_per_token(spec: ModelSpec, elem_bytes: int | None = None) -> int:
    return kv_elements_per_token(spec) * (elem_bytes or spec.kv_elem_bytes)


def quant_bytes_per_token(spec: ModelSpec, bits: int, group_size: int) -> int:
    """Packed payload plus the scale+min of each group, amortised over the group's tokens.

    Keys are grouped per channel over ``group_size`` tokens and values per token over
    ``group_size`` channels; either way one group of ``group_size`` elements carries 2 scales."""
    elems = kv_elements_per_token(spec)
    return elems * bits // 8 + (elems // group_size) * 2 * SCALE_BYTES


def kv_bytes_per_token(spec: ModelSpec, policy: KVPolicy) -> int:
    """Steady-state bytes per cached token (quantized tokens; the residual is a fixed extra)."""
    if policy.quantized:
        return quant_bytes_per_token(spec, policy.bits, policy.group_size)
    return full_bytes_per_token(spec)


def split_tokens(policy: KVPolicy, kept: int) -> tuple[int, int]:
    """(quantized, full-precision) tokens among ``kept`` cached tokens.

    Tokens are quantized a whole group at a time once they are older than the residual."""
    if not policy.quantized:
        return 0, kept
    g = policy.group_size
    quantized = max(0, kept - policy.residual) // g * g
    return quantized, kept - quantized


def kv_bytes(spec: ModelSpec, policy: KVPolicy, n_tokens: int) -> int:
    """Exact KV bytes after ``n_tokens`` tokens have streamed through a cache with ``policy``."""
    kept = policy.kept_tokens(max(0, n_tokens))
    quantized, full = split_tokens(policy, kept)
    q_bytes = quant_bytes_per_token(spec, policy.bits, policy.group_size) * quantized if quantized else 0
    return q_bytes + full_bytes_per_token(spec) * full


def paged_kv_bytes(spec: ModelSpec, policy: KVPolicy, n_tokens: int, block_size: int) -> int:
    """Bytes of the whole blocks a paged full-precision cache holds after ``n_tokens`` tokens:
    ``kv_bytes`` rounded up to the block (what the pool has reserved, not only what is filled)."""
    if policy.quantized:
        raise ValueError("paged_kv_bytes covers full-precision blocks; quantized blocks are sized by kv_bytes")
    kept = policy.kept_tokens(max(0, n_tokens))
    return -(-kept // block_size) * block_size * full_bytes_per_token(spec)


def max_kv_bytes(spec: ModelSpec, policy: KVPolicy, context: int) -> int:
    """Peak KV bytes over a stream of ``context`` tokens (bounded policies stop growing)."""
    return max(kv_bytes(spec, policy, n) for n in _peak_candidates(policy, context))


def _peak_candidates(policy: KVPolicy, context: int) -> list[int]:
    cap = policy.capacity()
    last = context if cap is None else min(context, cap)
    # the full-precision tail is largest just before a group is quantized
    return sorted({last, max(0, last - 1), *(last - i for i in range(min(last, policy.group_size)))})


def decode_tok_s_roofline(bandwidth_bytes_s: float, weight_bytes: int, kv_read_bytes: int,
                          batch: int = 1) -> float:
    """Upper bound on aggregate decode tok/s: every step reads the weights once and each sequence's KV."""
    per_step = weight_bytes + batch * kv_read_bytes
    return batch * bandwidth_bytes_s / per_step if per_step else float("inf")


def prefill_flops(spec: ModelSpec, n_tokens: int) -> float:
    """≈ 2·params·n for the matmuls plus the n² attention term (QKᵀ and PV)."""
    attn = 2 * 2 * spec.n_layers * spec.n_heads * spec.head_dim * n_tokens * n_tokens / 2
    return 2.0 * spec.n_params * n_tokens + attn


def format_bytes(n: float) -> str:
    """1536 → '1.5 KiB'; the one place the UI turns bytes into text."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
