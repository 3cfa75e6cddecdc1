"""Rotary position embedding (RoPE), and moving already-rotated K to new positions.

RoPE turns each pair of channels of a head by the angle ``position * freq_i``.
Plain RoPE has ``freq_i = theta ** (-2i / rotary_dim)``; scaled variants
(Llama-3's "llama3", "linear") use other frequencies, which
:attr:`RopeSpec.inv_freq` carries (:meth:`RopeSpec.from_rope_parameters`
computes them from a model config). Rotations by angles add, so K computed at
position ``p`` becomes K at ``p + d`` by one more rotation by ``d``:
:func:`rerotate` needs only the position delta, not the unrotated K. Angles
are computed in float64, so large positions lose no precision before the
cos/sin are cast to the tensor's dtype (:func:`rerotate`: to at least
float32, the result rounded to K's dtype once).

Tensors are ``[num_tokens, num_heads, head_size]``: a flat ``[num_tokens,
num_heads * head_size]`` one would be rotated as a single wide head, wrongly,
so it is refused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["RopeSpec", "apply_rope", "check_heads", "rerotate", "rope_cos_sin", "rotate"]

# rope_type values of HF / vLLM configs whose angles are not position * a fixed frequency
# (or whose frequencies ncclkv does not compute): refused, never approximated.
_UNSUPPORTED_WHY = {
    "dynamic": "its frequencies depend on the sequence length, so K cached at one length does not re-rotate "
               "to another",
    "yarn": "ncclkv does not compute its frequencies; its angles are position * inv_freq and its mscale "
            "scales fresh and cached K alike, so RopeSpec(inv_freq=<the model's>) re-rotates it exactly",
}


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """The model's RoPE: base ``theta``, how many leading channels of a head rotate
    (``rotary_dim``, None = the whole head), and the channel pairing: NeoX / Llama
    style pairs channel ``i`` with ``i + rotary_dim/2`` (``neox_style=True``), GPT-J
    style pairs ``2i`` with ``2i + 1``.

    ``inv_freq``: the model's ``rotary_dim / 2`` rotation frequencies (angle =
    position * inv_freq[i]; a sequence or 1-D tensor, kept as a tuple of floats);
    when given they replace the ones derived from ``theta``. A model that also multiplies cos and sin by a constant (YaRN's
    mscale) scales fresh and cached K alike: :func:`rerotate` stays exact (it
    must not apply the factor again), :func:`apply_rope` does not apply it.
    """

    theta: float = 10000.0
    rotary_dim: int | None = None
    neox_style: bool = True
    inv_freq: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.theta, bool) or not isinstance(self.theta, (int, float)) or not self.theta > 1.0:
            raise ValueError(f"rope theta must be a number > 1, got {self.theta!r}")
        dim = self.rotary_dim
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2):
            raise ValueError(f"rotary_dim must be None or an even int >= 2, got {dim!r}")
        if self.inv_freq is not None:
            freqs = _frequencies(self.inv_freq)
            if dim is not None and len(freqs) != dim // 2:
                raise ValueError(f"inv_freq has {len(freqs)} frequencies, rotary_dim {dim} needs {dim // 2}")
            object.__setattr__(self, "inv_freq", freqs)  # a tuple of floats: hashable, comparable

    @classmethod
    def from_rope_parameters(cls, rope_parameters: Mapping[str, object] | None, *, rotary_dim: int,
                             theta: float | None = None, neox_style: bool = True) -> RopeSpec:
        """The RoPE of a model config: HF's ``rope_scaling`` (with ``theta`` = its ``rope_theta``) or
        vLLM's / HF's ``rope_parameters`` (which hold ``rope_theta``); None = plain RoPE.

        Takes ``rope_type`` (or the older ``type``) "default", "linear" (``factor``) and "llama3"
        (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
        raises ValueError for any other (e.g. "dynamic", "yarn") rather than re-rotate with wrong angles.
        """
        params = dict(rope_parameters or {})
        given = None if params.get("rope_theta") is None else _number("rope_theta", params["rope_theta"])
        base = given if theta is None else _number("theta", theta)
        if base is None:
            raise ValueError("theta is needed: pass theta= or rope_parameters with 'rope_theta'")
        if given is not None and given != base:
            raise ValueError(f"theta={theta!r} disagrees with rope_parameters['rope_theta']={given!r}")
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be an even int >= 2, got {rotary_dim!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        spec = cls(theta=base, rotary_dim=rotary_dim, neox_style=neox_style)
        if kind == "default":
            return spec
        plain = spec.frequencies(rotary_dim)
        if kind == "linear":
            # Positions divided by the factor: the same angles as frequencies divided by it.
            freqs = plain / _number("factor", _required(params, "linear", "factor"))
        elif kind == "llama3":
            freqs = _llama3_frequencies(plain, params)
        elif kind in _UNSUPPORTED_WHY:
            raise ValueError(f"rope_type {kind!r} is not supported: {_UNSUPPORTED_WHY[kind]}")
        else:
            raise ValueError(f"rope_type {kind!r} is not supported (supported: 'default', 'linear', 'llama3'); "
                             "if the model rotates by position * fixed frequencies pass RopeSpec(inv_freq=...)")
        return cls(theta=base, rotary_dim=rotary_dim, neox_style=neox_style, inv_freq=tuple(freqs.tolist()))

    def dim_for(self, head_size: int) -> int:
        """The number of rotated channels for heads of ``head_size``."""
        dim = head_size if self.rotary_dim is None else self.rotary_dim
        if dim > head_size or dim % 2:
            raise ValueError(f"rotary_dim {dim} does not fit head_size {head_size} (needs even, <= head_size)")
        if self.inv_freq is not None and len(self.inv_freq) != dim // 2:
            raise ValueError(f"inv_freq has {len(self.inv_freq)} frequencies, {dim} rotated channels of "
                             f"head_size {head_size} need {dim // 2}")
        return dim

    def frequencies(self, head_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The float64 ``[rotary_dim // 2]`` rotation frequencies for heads of ``head_size``."""
        dim = self.dim_for(head_size)
        if self.inv_freq is not None:
            return torch.tensor(self.inv_freq, dtype=torch.float64, device=device)
        exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim
        return float(self.theta) ** -exponents


def rope_cos_sin(
    positions: torch.Tensor, spec: RopeSpec, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[num_tokens, rotary_dim // 2]`` of each token's angles (positions may be negative)."""
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    freqs = spec.frequencies(head_size, positions.device)
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_size]`` by precomputed angles; returns a new tensor."""
    check_heads("x", x)
    if x.shape[0] != cos.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens but the angles are for {cos.shape[0]}")
    half = cos.shape[-1]
    dim = 2 * half
    view = (x.shape[0], 1, half)
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
    """RoPE of ``x`` ``[num_tokens, num_heads, head_size]`` at ``positions`` ``[num_tokens]``."""
    check_heads("x", x)
    cos, sin = rope_cos_sin(positions, spec, x.shape[-1], x.dtype)
    return rotate(x, cos, sin, spec)


def rerotate(
    k: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor, spec: RopeSpec
) -> torch.Tensor:
    """K rotated at ``from_positions`` moved to ``to_positions`` (rotation by the delta), rotated in at least
    float32 and returned in K's dtype."""
    if from_positions.shape != to_positions.shape:
        raise ValueError(f"from_positions {tuple(from_positions.shape)} and to_positions "
                         f"{tuple(to_positions.shape)} differ in shape")
    check_heads("k", k)
    # On K's device: a stored chunk's positions stay on the CPU while its K may be on a GPU.
    delta = (to_positions.to(device=k.device, dtype=torch.int64)
             - from_positions.to(device=k.device, dtype=torch.int64))
    # In at least float32, rounded once at the end: K is already rounded to its dtype, and a rotation in
    # bf16 / fp16 (cos, sin and the products rounded) would add several roundings more.
    cos, sin = rope_cos_sin(delta, spec, k.shape[-1], torch.promote_types(k.dtype, torch.float32))
    return rotate(k, cos, sin, spec).to(k.dtype)


def check_heads(name: str, x: torch.Tensor) -> None:
    """Refuse anything but ``[num_tokens, num_heads, head_size]``: RoPE rotates within one head."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D [num_tokens, num_heads, head_size], got shape {tuple(x.shape)}; "
                         "view a flat [num_tokens, num_heads * head_size] tensor (vLLM's qkv split) as "
                         "[num_tokens, num_heads, head_size] first")


def _frequencies(inv_freq: Sequence[float] | torch.Tensor) -> tuple[float, ...]:
    if isinstance(inv_freq, torch.Tensor):
        if inv_freq.dim() != 1 or not inv_freq.is_floating_point():
            raise ValueError(f"inv_freq must be a 1-D floating tensor, got {inv_freq.dtype} {tuple(inv_freq.shape)}")
        values = inv_freq.detach().to("cpu", torch.float64).tolist()
    elif isinstance(inv_freq, Sequence) and not isinstance(inv_freq, (str, bytes)):
        values = list(inv_freq)
    else:
        raise TypeError(f"inv_freq must be a sequence of numbers or a 1-D tensor, got {type(inv_freq).__name__}")
    bad = [f for f in values if isinstance(f, bool) or not isinstance(f, numbers.Real) or not math.isfinite(f)
           or f <= 0]
    if not values or bad:
        raise ValueError(f"inv_freq must be >= 1 finite numbers > 0, got {len(values)} values, bad ones: {bad[:4]!r}")
    return tuple(float(f) for f in values)


def _required(params: Mapping[str, object], kind: str, key: str) -> object:
    if key not in params:
        raise ValueError(f"rope_type {kind!r} needs {key!r} in rope_parameters, got keys {sorted(params)}")
    return params[key]


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _llama3_frequencies(plain: torch.Tensor, params: Mapping[str, object]) -> torch.Tensor:
    """Llama-3.x scaling: long wavelengths slowed by ``factor``, short ones kept, a linear blend between."""
    factor = _number("factor", _required(params, "llama3", "factor"))
    low = _number("low_freq_factor", _required(params, "llama3", "low_freq_factor"))
    high = _number("high_freq_factor", _required(params, "llama3", "high_freq_factor"))
    original = _number("original_max_position_embeddings",
                       _required(params, "llama3", "original_max_position_embeddings"))
    if high < low:
        raise ValueError(f"high_freq_factor {high} must be >= low_freq_factor {low}")
    wavelength = 2 * math.pi / plain
    # Where the blend applies: wavelengths between original/high and original/low (none if they are equal).
    weight = (original / wavelength - low) / (high - low) if high != low else torch.zeros_like(plain)
    blended = (1 - weight) * plain / factor + weight * plain
    return torch.where(wavelength < original / high, plain,
                       torch.where(wavelength > original / low, plain / factor, blended))
