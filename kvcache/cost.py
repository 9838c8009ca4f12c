"""The cost model: the KV-byte and roofline arithmetic that the planner and every UI share.

A cache's reported bytes must equal ``kv_bytes`` for the same policy and token count. Bytes are
counted layer by layer (kvcache/model_spec.py ``LayerAttention``): full layers hold every kept token,
sliding layers at most their window, layers without attention nothing; K and V have their own
head dims. A mixture of experts reads its dense weights plus the active experts per decoded token
(``ModelSpec.decode_weight_bytes``)."""
from __future__ import annotations

from dataclasses import replace

from localctx.kvcache.eviction import held_counts
from localctx.kvcache.policy import KVPolicy
from localctx.kvcache.model_spec import SLIDING, LayerAttention, ModelSpec

SCALE_BYTES = 2  # each quantization group stores a scale and a min, fp16 each


def layer_policy(policy: KVPolicy, layer: LayerAttention) -> KVPolicy | None:
    """The policy one layer's cache runs: None for a layer that holds no KV; on a sliding layer the
    model's own window, unless the policy keeps fewer tokens (a policy window applies on top only
    where it is smaller: then the policy's sinks + window govern that layer too)."""
    if not layer.holds_kv:
        return None
    if layer.kind != SLIDING:
        return policy
    kept = policy.capacity()
    if kept is not None and kept <= layer.window:
        return policy
    return replace(policy, sinks=0, heavy=0, window=layer.window)


def layer_full_bytes(layer: LayerAttention, elem_bytes: int) -> int:
    """Bytes one full-precision token takes in ``layer`` (K and V, each with its own head dim)."""
    return (layer.k_width + layer.v_width) * elem_bytes


def side_quant_bytes(width: int, bits: int, group_size: int, elem_bytes: int) -> int:
    """Bytes one token of a quantized group takes on one side (K or V) of a layer ``width`` wide:
    at 16 bits the side stays in the model's precision (``elem_bytes``), with no scales."""
    if bits == 16:
        return width * elem_bytes
    return width * bits // 8 + (width // group_size) * 2 * SCALE_BYTES


def layer_quant_bytes(layer: LayerAttention, k_bits: int, v_bits: int, group_size: int, elem_bytes: int) -> int:
    """Packed payload plus the fp16 scale+min of each group, amortised over the group's tokens.

    Keys are grouped per channel over ``group_size`` tokens (one scale+min per channel per
    group) and values per token over ``group_size`` channels (one scale+min per token per
    channel group); either way ``group_size`` elements carry one scale and one min. A side at 16
    bits (kf16v4: keys) is held in the model's precision inside the group. Exact for head dims
    that are a multiple of the group size (the cache refuses the others)."""
    return (side_quant_bytes(layer.k_width, k_bits, group_size, elem_bytes)
            + side_quant_bytes(layer.v_width, v_bits, group_size, elem_bytes))


def kv_elements_per_token(spec: ModelSpec) -> int:
    """K and V elements one token adds across all layers that hold KV (before any window)."""
    return sum((layer.k_width + layer.v_width) * count for layer, count in spec.layer_groups())


def full_bytes_per_token(spec: ModelSpec, elem_bytes: int | None = None) -> int:
    return kv_elements_per_token(spec) * (elem_bytes or spec.kv_elem_bytes)


def quant_bytes_per_token(spec: ModelSpec, k_bits: int, v_bits: int, group_size: int) -> int:
    return sum(layer_quant_bytes(layer, k_bits, v_bits, group_size, spec.kv_elem_bytes) * count
               for layer, count in spec.layer_groups())


def kv_bytes_per_token(spec: ModelSpec, policy: KVPolicy) -> int:
    """Steady-state bytes per cached token in every layer (quantized tokens; the residual is a fixed extra)."""
    if policy.quantized:
        return quant_bytes_per_token(spec, policy.k_bits, policy.v_bits, policy.group_size)
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
    """Exact KV bytes after ``n_tokens`` tokens have streamed through a cache with ``policy``, layer by
    layer (``layer_policy``): quantized tokens at ``layer_quant_bytes`` (payload + group scales/mins),
    the rest at the model's full precision; a sliding layer holds at most its window, a layer
    without attention nothing. Bookkeeping (positions, attention mass) is not KV and not counted."""
    total = 0
    for layer, count in spec.layer_groups():
        lp = layer_policy(policy, layer)
        if lp is None:
            continue
        quantized, full = split_tokens(lp, n_tokens)
        q_bytes = layer_quant_bytes(layer, lp.k_bits, lp.v_bits, lp.group_size, spec.kv_elem_bytes) * quantized
        total += count * (q_bytes + layer_full_bytes(layer, spec.kv_elem_bytes) * full)
    return total


def full_precision_equivalent(spec: ModelSpec, policy: KVPolicy, n_tokens: int) -> int:
    """What the tokens each layer keeps would take at full precision (the speed model's floor)."""
    total = 0
    for layer, count in spec.layer_groups():
        lp = layer_policy(policy, layer)
        if lp is not None:
            total += count * lp.kept_tokens(max(0, n_tokens)) * layer_full_bytes(layer, spec.kv_elem_bytes)
    return total


def paged_kv_bytes(spec: ModelSpec, policy: KVPolicy, n_tokens: int, block_size: int) -> int:
    """Bytes of the whole blocks a paged full-precision cache holds after ``n_tokens`` tokens:
    each layer's kept tokens rounded up to the block (what the pool has reserved, not only what is filled)."""
    if policy.quantized:
        raise ValueError("paged_kv_bytes covers full-precision blocks; quantized blocks are sized by kv_bytes")
    total = 0
    for layer, count in spec.layer_groups():
        lp = layer_policy(policy, layer)
        if lp is not None:
            kept = lp.kept_tokens(max(0, n_tokens))
            total += count * -(-kept // block_size) * block_size * layer_full_bytes(layer, spec.kv_elem_bytes)
    return total


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
    """≈ 2·(active params)·n for the matmuls plus the attention term (QKᵀ and PV): n²/2 query-key
    pairs on a full layer, n·w − w²/2 on a layer sliding over w tokens, none where there is no attention."""
    n = n_tokens
    pairs = 0.0
    for layer, count in spec.layer_groups():
        if not layer.holds_kv:
            continue
        w = min(n, layer.window) if layer.kind == SLIDING else n
        pairs += count * (n * w - w * w / 2)
    attn = 2 * 2 * spec.n_heads * spec.head_dim * pairs
    return 2.0 * spec.active_params * n + attn


def format_bytes(n: float) -> str:
    """1536 → '1.5 KiB'; the one place the UI turns bytes into text."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def layout_note(spec: ModelSpec, policy: KVPolicy) -> str:
    """Where the model's own attention shapes the KV: sliding layers capped at their window, layers
    without attention, experts read per token."""
    layers = spec.attention()
    sliding = [layer for layer in layers if layer.kind == "sliding"]
    none = sum(1 for layer in layers if not layer.holds_kv)
    notes = []
    if sliding:
        windows = sorted({layer.window for layer in sliding})
        capped = sum(1 for layer in sliding if layer_policy(policy, layer).window == layer.window)
        notes.append(f"{len(sliding)} of {len(layers)} layers slide over {', '.join(f'{w:,}' for w in windows)} "
                     f"tokens and hold at most that ({capped} capped by their own window, "
                     f"{len(sliding) - capped} by the policy's)")
    if none:
        notes.append(f"{none} layers hold no KV (recurrent or linear attention)")
    if spec.moe:
        notes.append(f"a decoded token reads {format_bytes(spec.decode_weight_bytes)} of weights "
                     f"({spec.moe.n_active} of {spec.moe.n_experts} experts)")
    return "; " + "; ".join(notes) if notes else ""
