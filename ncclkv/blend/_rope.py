"""Rotary position embedding (RoPE), and moving already-rotated K to new positions.

RoPE turns each pair of channels of a head by the angle ``position * freq_i``
with ``freq_i = theta ** (-2i / rotary_dim)``. Rotations by angles add, so K
computed at position ``p`` becomes K at ``p + d`` by one more rotation by
``d``: :func:`rerotate` needs only the position delta, not the unrotated K.
Angles are computed in float64, so large positions lose no precision before
the cos/sin are cast to the tensor's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RopeSpec", "apply_rope", "rerotate", "rope_cos_sin", "rotate"]


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """The model's RoPE: base ``theta``, how many leading channels of a head rotate
    (``rotary_dim``, None = the whole head), and the channel pairing: NeoX / Llama
    style pairs channel ``i`` with ``i + rotary_dim/2`` (``neox_style=True``), GPT-J
    style pairs ``2i`` with ``2i + 1``."""

    theta: float = 10000.0
    rotary_dim: int | None = None
    neox_style: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.theta, bool) or not isinstance(self.theta, (int, float)) or not self.theta > 1.0:
            raise ValueError(f"rope theta must be a number > 1, got {self.theta!r}")
        dim = self.rotary_dim
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2):
            raise ValueError(f"rotary_dim must be None or an even int >= 2, got {dim!r}")

    def dim_for(self, head_size: int) -> int:
        """The number of rotated channels for heads of ``head_size``."""
        dim = head_size if self.rotary_dim is None else self.rotary_dim
        if dim > head_size or dim % 2:
            raise ValueError(f"rotary_dim {dim} does not fit head_size {head_size} (needs even, <= head_size)")
        return dim


def rope_cos_sin(
    positions: torch.Tensor, spec: RopeSpec, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[num_tokens, rotary_dim // 2]`` of each token's angles (positions may be negative)."""
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    dim = spec.dim_for(head_size)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim
    freqs = float(spec.theta) ** -exponents
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, ..., head_size]`` by precomputed angles; returns a new tensor."""
    if x.shape[0] != cos.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens but the angles are for {cos.shape[0]}")
    half = cos.shape[-1]
    dim = 2 * half
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(view), sin.view(view)
    if spec.neox_style:
        x1, x2 = x[..., :half], x[..., half:dim]
        turned = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x[..., 0:dim:2], x[..., 1:dim:2]
        turned = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if dim == x.shape[-1]:
        return turned
    return torch.cat((turned, x[..., dim:]), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """RoPE of ``x`` ``[num_tokens, ..., head_size]`` at ``positions`` ``[num_tokens]``."""
    cos, sin = rope_cos_sin(positions, spec, x.shape[-1], x.dtype)
    return rotate(x, cos, sin, spec)


def rerotate(
    k: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor, spec: RopeSpec
) -> torch.Tensor:
    """K rotated at ``from_positions`` moved to ``to_positions`` (rotation by the delta)."""
    if from_positions.shape != to_positions.shape:
        raise ValueError(f"from_positions {tuple(from_positions.shape)} and to_positions "
                         f"{tuple(to_positions.shape)} differ in shape")
    delta = to_positions.to(torch.int64) - from_positions.to(device=to_positions.device, dtype=torch.int64)
    return apply_rope(k, delta, spec)
