"""What each query of a prefill chunk sees, so that a chunk attends exactly as decoding the same
tokens one at a time would (``PolicyKVCache.attend``).

Decoding token p (stream index, 0 = first token) attends over the cache as the previous step left
it — aged and evicted at p tokens (``kvcache/eviction.py``) — plus token p itself; a layer that
keeps exactly its model's window first evicts at p + 1 (what p cannot see). Within a chunk the
cache changes between queries: the window moves on, groups age into their quantized form. So for
each query p and each key (a stored token, or one of two forms of a token whose group ages
during the chunk) the view decides:

- held: the key's unit (the token, or its whole quantized group, rule 3) is a sink or is still
  inside the window at p; a query never sees a later token;
- form: the quantized form where the token's group is quantized at p (rule 2: the group is past
  the head and ``(k + 1)·g ≤ p − S − R``), the full-precision form elsewhere;
- the model's own window, where the layer slides (query − key < window, sinks exempt);
- distance: positions in the cache are ranks among the held tokens. Without heavy hitters the
  held main stream is one run ending at p, so a main key's distance is its stream distance; a
  sink's is p's rank minus its own, which shrinks as eviction drops the tokens between (the
  sinks then get a frame of their own, ``ChunkView.sink_keys``).

Heavy hitters are not handled here: which units a window eviction keeps depends on the
attention mass up to that eviction, so the cache splits such a chunk into sub-steps instead
(``substep_length``).

The arithmetic is framework-neutral (no torch import): the torch policy cache gives it tensors,
the MLX cache (backends/mlx/policy_cache.py) numpy arrays."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localctx.kvcache import eviction
from localctx.kvcache.policy import KVPolicy


def appends_only(policy: KVPolicy, n_seen: int, n_new: int, evicts_first: bool) -> bool:
    """Whether every query of ``n_new`` tokens after ``n_seen`` sees what the first one sees plus
    the chunk's earlier tokens (nothing aged or evicted in between): one causal attention is then
    exact. ``evicts_first``: the layer evicts at p + 1 before query p attends (it keeps exactly
    its model's window)."""
    if n_new == 1:
        return True
    first, last = eviction.held_counts(policy, n_seen), eviction.held_counts(policy, n_seen + n_new - 1)
    if first.quant_groups != last.quant_groups:
        return False
    if evicts_first:  # nothing is evicted even at the last query's n + 1
        return policy.window is None or n_seen + n_new - policy.sinks <= policy.window
    return last.tokens == first.tokens + n_new - 1


def substep_length(policy: KVPolicy, n_seen: int, n_new: int) -> int:
    """Tokens from ``n_seen`` on (at most ``n_new``) that one step attends exactly as decoding:
    the first, and each next one while the cache before it is the one before the first plus the
    earlier tokens (``appends_only``). A chunk under heavy hitters runs as such sub-steps."""
    base = eviction.held_counts(policy, n_seen)
    r = 1
    while r < n_new:
        after = eviction.held_counts(policy, n_seen + r)
        if after.quant_groups != base.quant_groups or after.tokens != base.tokens + r:
            break
        r += 1
    return r


@dataclass(frozen=True)
class ChunkView:
    """What each query of a chunk sees, in the arrays the caller gave (torch tensors or numpy
    arrays: the arithmetic below is written with operators both share)."""
    visible: Any  # [T, L] bool
    key_positions: Any  # [L] int: where each key is rotated
    q_positions: Any  # [T] int: where each query is rotated against the keys
    # keys whose distance to a query is taken in a frame of their own (the sinks, once eviction
    # has moved them closer: query − key is then q_sink_positions − key_positions); None: none
    sink_keys: Any = None  # [L] bool
    q_sink_positions: Any = None  # [T] int


def chunk_view(policy: KVPolicy, query_index, key_index, key_quantized, *, evicts_first: bool = False,
               model_window: int | None = None) -> ChunkView:
    """The view of the queries of stream indices ``query_index`` [T] (consecutive) over keys of
    stream indices ``key_index`` [L], in the form ``key_quantized`` [L] (bool) says — integer
    arrays of one framework, torch or numpy. The keys are what the layer holds for the first
    query, the chunk's tokens, and the full-precision form of the groups that age during the
    chunk. No heavy hitters (see the module docstring)."""
    if eviction.heavy_units(policy):
        raise ValueError(f"a chunk under heavy hitters ({policy}) runs as sub-steps, not one view")
    S, g, W = policy.sinks, policy.group_size, policy.window
    p, j = query_index[:, None], key_index[None, :]  # [T, 1], [1, L]
    is_sink = j < S
    main = j - S
    group = main // g  # floor division on both frameworks
    held = j <= p  # a query never sees a later token
    if eviction.quantizes(policy):
        quant_at = ~is_sink & (group >= eviction.head_groups(policy)) & ((group + 1) * g <= p - S - policy.residual)
        newest = main + quant_at * ((group + 1) * g - 1 - main)  # a quantized group leaves whole
        held = held & (key_quantized[None, :] == quant_at)  # one form of each token at each query
    else:
        newest = main
        held = held & ~key_quantized[None, :]
    if W is not None:
        m = p - S + (1 if evicts_first else 0)
        held = held & (is_sink | (newest >= m - W))
    q_rank = held.sum(-1) - 1  # p's position in the cache: tokens held before it
    visible = held
    if model_window is not None:
        visible = held & ((p - j < model_window) | is_sink)
    # main keys: stream distance, in a frame where the first query sits at its cache position
    base = int(query_index[0]) - int(q_rank[0])
    q_main = query_index - base
    key_pos = key_index - base * ~is_sink[0]
    if not S or bool((q_rank == q_main).all()):  # nothing evicted within the chunk: one frame
        return ChunkView(visible, key_pos, q_main)
    return ChunkView(visible, key_pos, q_main, is_sink[0], q_rank)
