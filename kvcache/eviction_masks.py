"""The eviction rules of eviction.py as torch masks (the torch caches' side; eviction.py itself
stays free of torch so the planner, the cost model and the MLX backend never import it)."""
from __future__ import annotations

import torch


def leaving(newest_main_index: torch.Tensor, m: int, window: int | None, is_sink: torch.Tensor) -> torch.Tensor:
    """Bool mask of units outside the window (rule 3); sinks never leave."""
    if window is None:
        return torch.zeros_like(is_sink)
    return (newest_main_index < m - window) & ~is_sink


def keep_heaviest(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Bool mask keeping the ``budget`` largest scores (ties keep the newer unit)."""
    keep = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    if budget <= 0 or scores.numel() == 0:
        return keep
    order = torch.argsort(scores.flip(0), descending=True, stable=True)
    chosen = scores.shape[0] - 1 - order[:budget]
    keep[chosen] = True
    return keep
