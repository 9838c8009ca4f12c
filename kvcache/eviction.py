"""Which tokens a policy cache holds: sinks, the recent window, heavy hitters, and which of them
are quantized. Pure arithmetic and selection; the cache (``kvcache/layer_store.py``) applies it.

The rules, for a stream of ``n`` tokens (index 0 = the first token) and a policy
``bits / g / residual R / sinks S / window W / heavy``:

1. **Sinks.** Tokens 0..S-1 are always kept, in full precision (they are few, and every query
   attends to them). The rest is the *main stream*; main index ``i`` = stream index − S, and
   ``m`` = max(0, n − S) main tokens have arrived.
2. **Quantization.** The main stream is cut into aligned groups of g tokens (group k = main
   indices kg … kg+g−1). Group k is quantized once it is entirely older than the residual:
   (k+1)·g ≤ m − R. Younger tokens stay in full precision. Without a window, group 0 (the
   *head*) is never quantized: the first tokens are where the attention sink forms (every
   query puts much of its attention there, so their key error shifts every query's softmax;
   docs/quality.md measures it). With a window group 0 is quantized and leaves like any
   other, and the sinks (rule 1) are what keeps the first tokens, in full precision.
   Quantization applies only when a group can age out of the residual before it leaves the
   window (W ≥ R + g, or no window); otherwise every kept token stays in full precision —
   nothing is ever quantized and then immediately thrown away. ``quantizes(policy)`` says which
   case holds.
3. **Window.** A unit (a full-precision token, or a whole quantized group) leaves the window
   when its newest token is older than the last W main tokens: newest main index < m − W.
   A quantized group is evicted whole, never split (splitting would mean re-quantizing its
   per-channel key scales), so with quantized KV the window holds W … W+g−1 tokens.
4. **Heavy hitters (H2O).** Units that left the window compete for ``heavy`` places by
   accumulated attention mass (each unit's mass summed over the queries that saw it, summed
   over its tokens for a group); the losers are dropped for good. Quantized units take whole
   groups: the budget is ceil(heavy / g) groups.

Everything stays in stream order; a kept token's position in the cache is its rank in that
order, so attention sees the cache as one contiguous sequence (docs/architecture.md "KV policies").
"""
from __future__ import annotations

from dataclasses import dataclass

from localctx.kvcache.policy import KVPolicy, precision_words


def policy_cache_layout(policy: KVPolicy) -> str:
    """What a policy cache (torch, MLX) holds for ``policy``, in words: exact or lossy, each side's
    precision, its groups and the tokens kept at full precision (the head group, the residual), and
    which tokens a window keeps. Other engines describe their own cache (``Backend.describe_kv``)."""
    kind = "exact" if policy.exact else "lossy"
    what = []
    if policy.quantized:
        exact_ends = [] if policy.evicts else [f"first {policy.group_size}"]  # the head group (rule 2)
        exact_ends += [f"last {policy.residual}"] if policy.residual else []
        what.append(f"{precision_words(policy.k_bits, policy.v_bits)} (groups of {policy.group_size}"
                    + (f", {' and '.join(exact_ends)} tokens full precision)" if exact_ends else ")"))
    else:
        what.append("full-precision KV")
    if policy.evicts:
        what.append(f"keeps first {policy.sinks} + last {policy.window}"
                    + (f" + {policy.heavy} heavy hitters" if policy.heavy else "") + " tokens")
    return f"{kind}: " + ", ".join(what)


def quantizes(policy: KVPolicy) -> bool:
    """Whether any token is ever held quantized under ``policy`` (rule 2)."""
    if not policy.quantized:
        return False
    return policy.window is None or policy.window >= policy.residual + policy.group_size


def head_groups(policy: KVPolicy) -> int:
    """Main-stream groups at the start that stay in full precision (rule 2): one in a quantizing
    cache without a window, none otherwise."""
    return 1 if quantizes(policy) and policy.window is None else 0


def heavy_units(policy: KVPolicy) -> int:
    """The heavy-hitter budget in eviction units: tokens, or whole groups when quantized."""
    if not policy.heavy:
        return 0
    if quantizes(policy):
        return -(-policy.heavy // policy.group_size)
    return policy.heavy


@dataclass(frozen=True)
class HeldCounts:
    """What a cache holds after a stream of n tokens (the same count in every layer)."""
    sink_tokens: int
    full_tokens: int  # full-precision main-stream tokens (recent residual / window / heavy)
    quant_groups: int  # quantized groups (window + heavy)
    group_size: int
    evicted_tokens: int

    @property
    def quant_tokens(self) -> int:
        return self.quant_groups * self.group_size

    @property
    def tokens(self) -> int:
        return self.sink_tokens + self.full_tokens + self.quant_tokens


def held_counts(policy: KVPolicy, n_tokens: int) -> HeldCounts:
    """The closed form of the rules above, for the cost model."""
    n = max(0, n_tokens)
    g = policy.group_size
    sinks = min(n, policy.sinks)
    m = n - sinks
    W = policy.window
    if quantizes(policy):
        formed = max(0, max(0, m - policy.residual) // g - head_groups(policy))
        full = m - formed * g
        first_in_window = 0 if W is None else max(0, m - W) // g
        heavy = min(first_in_window, heavy_units(policy))
        groups = formed - first_in_window + heavy
        return HeldCounts(sinks, full, groups, g, m - full - groups * g)
    window = m if W is None else min(m, W)
    heavy = min(m - window, heavy_units(policy))
    return HeldCounts(sinks, window + heavy, 0, g, m - window - heavy)
