"""Choosing the tokens to recompute, and checking batch boundaries."""

from __future__ import annotations

import math

import torch

__all__ = ["check_query_start_loc", "select_tokens"]


def check_query_start_loc(query_start_loc: torch.Tensor, num_tokens: int, what: str) -> list[int]:
    """``query_start_loc`` as a list: 1-D, starts at 0, non-decreasing, ends at ``num_tokens``."""
    if not isinstance(query_start_loc, torch.Tensor):
        raise TypeError(f"{what}: query_start_loc must be a tensor, got {type(query_start_loc).__name__}")
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 2:
        shape = tuple(query_start_loc.shape)
        raise ValueError(f"{what}: query_start_loc must be a 1-D tensor of num_requests + 1 >= 2 entries, got {shape}")
    bounds = [int(b) for b in query_start_loc.tolist()]
    if bounds[0] != 0 or bounds[-1] != num_tokens or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{what}: query_start_loc {bounds} must rise from 0 to num_tokens={num_tokens}")
    return bounds


def select_tokens(
    deviation: torch.Tensor, valid_mask: torch.Tensor, bounds: list[int], ratio: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (ascending, int64) of the tokens to recompute, and the new query_start_loc.

    Per request ``[bounds[i], bounds[i+1])``: every invalid token, the last
    token (it produces the next-token logits), and the ``ceil(ratio *
    num_valid)`` other valid tokens with the largest ``deviation``.
    """
    device = deviation.device
    forced = ~valid_mask.to(device)
    ends = torch.tensor([stop - 1 for start, stop in zip(bounds, bounds[1:]) if stop > start], device=device)
    forced[ends.to(torch.int64)] = True
    score = torch.where(forced, torch.full_like(deviation, -math.inf), deviation.nan_to_num(nan=math.inf))
    valid = valid_mask.to(device)
    chosen = forced.clone()
    counts: list[int] = []
    for start, stop in zip(bounds, bounds[1:]):
        num_valid = int(valid[start:stop].sum())
        num_free = int((~forced[start:stop]).sum())
        # Guard against ratio * n landing a hair above an integer (0.15 * 100).
        take = min(num_free, math.ceil(ratio * num_valid - 1e-9))
        if take > 0:
            top = torch.topk(score[start:stop], take, sorted=False).indices
            chosen[start + top] = True
        counts.append(int(chosen[start:stop].sum()))
    indices = chosen.nonzero().flatten()
    query_start_loc = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(device)
    return indices, query_start_loc
