"""The values CacheBlend passes around: its config, a retrieved layer, a blended layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._rope import RopeSpec

__all__ = ["BlendConfig", "BlendOutput", "BlendRetrieverResult"]


@dataclass(frozen=True, slots=True)
class BlendConfig:
    """How the executor blends.

    ``check_layer``: layers before it are computed in full with fresh K/V; at
    it the tokens to recompute are chosen; from it on only those tokens are
    computed. ``recompute_ratio``: the fraction of each request's retrieved
    (valid) tokens to recompute, those whose K deviates most; invalid tokens
    and each request's last token are always recomputed on top. ``rope``: the
    model's rotary embedding, used to move retrieved K to its new positions.
    """

    check_layer: int = 1
    recompute_ratio: float = 0.15
    rope: RopeSpec = field(default_factory=RopeSpec)

    def __post_init__(self) -> None:
        if isinstance(self.check_layer, bool) or not isinstance(self.check_layer, int) or self.check_layer < 0:
            raise ValueError(f"check_layer must be an int >= 0, got {self.check_layer!r}")
        ratio = self.recompute_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be a number in [0, 1], got {ratio!r}")
        if not isinstance(self.rope, RopeSpec):
            raise TypeError(f"rope must be a RopeSpec, got {type(self.rope).__name__}")


@dataclass(frozen=True, slots=True, eq=False)
class BlendRetrieverResult:
    """One layer of retrieved KV for the whole batch (requests concatenated along tokens).

    ``k`` / ``v``: ``[num_tokens, num_kv_heads, head_size]``, or None when no
    chunk of the batch was found. ``valid_mask``: bool ``[num_tokens]`` on the
    CPU; where False the K/V rows are undefined (zero here). ``original_positions``:
    int64 ``[num_tokens]``, the positions the retrieved KV was computed at (0
    where invalid), on the device of K and V.
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    valid_mask: torch.Tensor
    original_positions: torch.Tensor


@dataclass(frozen=True, slots=True, eq=False)
class BlendOutput:
    """What one layer computes with after blending.

    ``q``: the short Q, only the tokens to compute. ``k`` / ``v``: the long
    K/V of every token, retrieved (re-rotated) values with fresh ones written
    over the computed tokens. ``positions``: positions of the ``q`` tokens in
    their request. ``local_indices``: where the ``q`` tokens sit in this
    layer's ``fresh_q`` (the caller keeps those rows of its hidden states).
    ``query_start_loc``: request boundaries within ``q`` once tokens have been
    selected (from the check layer on), None before.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    local_indices: torch.Tensor
    query_start_loc: torch.Tensor | None
