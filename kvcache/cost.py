"""The cost model: the KV-byte and roofline arithmetic that the planner and every UI share.

A cache's reported bytes must equal ``kv_bytes`` for the same policy and token count."""
from __future__ import annotations

from localctx.kvcache.eviction import held_counts
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.spec import ModelSpec

SCALE_BYTES = 2  # each quantization group stores a scale and a min, fp16 each


def kv_elements_per_token(spec: ModelSpec) -> int:
    """K and V elements one token adds across all layers."""
    return 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim


def full_bytes_per_token(spec: ModelSpec, elem_bytes: int | None = None) -> int:
    return kv_elements_per_token(spec) * (elem_bytes or spec.kv_elem_bytes)


def quant_bytes_per_token(spec: ModelSpec, bits: int, group_size: int) -> int:
    """Packed payload plus the fp16 scale+min of each group, amortised over the group's tokens.

    Keys are grouped per channel over ``group_size`` tokens (one scale+min per channel per
    group) and values per token over ``group_size`` channels (one scale+min per token per
    channel group); either way ``group_size`` elements carry one scale and one min. Exact for
    head dims that are a multiple of the group size (the cache refuses the others)."""
    elems = kv_elements_per_token(spec)
    return elems * bits // 8 + (elems // group_size) * 2 * SCALE_BYTES


def kv_bytes_per_token(spec: ModelSpec, policy: KVPolicy) -> int:
    """Steady-state bytes per cached token (quantized tokens; the residual is a fixed extra)."""
    if policy.quantized:
        return quant_bytes_per_token(spec, policy.bits, policy.group_size)
    return full_bytes_per_token(spec)


def split_tokens(policy: KVPolicy, n_tokens: int) -> tuple[int, int]:
    """(quantized, full-precision) tokens a cache holds after ``n_tokens`` have streamed in.

    What the cache stores (kvcache/eviction.py has the rules): the sinks stay full precision;
    the main stream is quantized a whole aligned group at a time once the group is older than
    the residual, and only when a group can age out of the residual inside the window
    (window >= residual + group, or no window), else everything held is full precision; with
    no window the first group of the main stream (the head) is never quantized; a
    quantized group leaves the window whole (so the window holds W..W+g-1 tokens), and heavy
    hitters among quantized tokens are whole groups (ceil(heavy / g) of them)."""
    held = held_counts(policy, n_tokens)
    return held.quant_tokens, held.sink_tokens + held.full_tokens


def held_tokens(policy: KVPolicy, n_tokens: int) -> int:
    """Tokens a cache holds after ``n_tokens`` (what attention sees)."""
    return held_counts(policy, n_tokens).tokens


def kv_bytes(spec: ModelSpec, policy: KVPolicy, n_tokens: int) -> int:
    """Exact KV bytes after ``n_tokens`` tokens have streamed through a cache with ``policy``:
    quantized tokens at ``quant_bytes_per_token`` (payload + group scales/mins), the rest at the
    model's full precision. Bookkeeping (positions, attention mass) is not KV and not counted."""
    quantized, full = split_tokens(policy, n_tokens)
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
    # Bytes grow with the stream until the window is full, then repeat with a period of one
    # group (a group is quantized, a group is evicted); the full-precision tail is largest just
    # before a group is quantized. The last few groups' worth of lengths cover every phase.
    span = 4 * policy.group_size + 2
    return list(range(max(0, context - span), context + 1))


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
