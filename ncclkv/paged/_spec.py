"""Paged KV cache layouts: what one layer's cache tensor looks like, per engine backend."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..errors import ShapeMismatchError

__all__ = ["CPU_LAYOUTS", "CacheLayout", "PagedCacheSpec", "amx_views", "detect_layout", "kv_view", "part_views", "wire_shape"]


class CacheLayout(enum.Enum):
    """How one layer's paged KV cache is laid out (``nb`` blocks of ``bs`` tokens, ``H`` heads of ``D``).

    - ``FLASH_NHD``: vLLM flash-attn, ``[2, nb, bs, H, D]``.
    - ``FLASH_HND``: the same logical shape with memory in ``[2, nb, H, bs, D]`` order.
      Either the contiguous tensor of that physical shape or vLLM's permuted view
      is accepted: of dims 2 and 3, the one with the larger stride is read as the
      heads (on equal strides, which block_size 1 gives, the size-1 dim as the tokens).
    - ``FLASHINFER``: ``[nb, 2, bs, H, D]``.
    - ``CPU``: ``[nb, H, bs, 2*D]`` whose memory per (block, head) is K ``[bs, D]``
      followed by V ``[bs, D]``, both token-major.
    - ``CPU_KT``: vLLM CPU, keys transposed per block: the same shape and halves as
      ``CPU``, but K is stored ``[D, bs]`` (V still ``[bs, D]``). vLLM 0.32's portable
      CPU kernels (ISA ``vec`` / ``vec16``, every dtype) write this. The shape cannot
      tell ``CPU`` from ``CPU_KT``: the caller must say which (:func:`detect_layout`
      answers ``CPU``). Whole blocks copied byte for byte survive either reading; tokens
      taken out of a block do not.
      Its keys move at transposed-copy speed (a few GB/s on CPU), its values as ``CPU``'s.
    - ``CPU_AMX``: vLLM CPU with the AMX ISA (bfloat16, block_size a multiple of 32):
      the same shape and halves, each packed for AMX tiles. K is ``[bs/16, D/2, 16, 2]``
      (tiles of 16 tokens; per token, pairs of dims), V ``[D/16, bs/2, 16, 2]`` (tiles
      of 16 dims; per dim, pairs of tokens). Needs ``bs`` and ``D`` multiples of 16;
      :func:`amx_views` reads it. Like ``CPU_KT``, never detected from the shape.
    - ``PACKED``: vLLM's GPU attention backends (0.32: FlashAttention, FlashInfer, Triton,
      FlexAttention, ...), ``[nb, H, bs, 2*D]`` whose last dim holds, per token and head,
      K then V (they read it as ``cache.transpose(1, 2).split(D, dim=-1)``). The shape is
      ``CPU``'s, the order inside it is not. The first three dims may lie in any memory
      order (vLLM's ``KVCacheLayout``: heads before tokens, tokens before heads, or blocks
      outermost, each block holding every layer's page): the strides say which. Never
      detected on a CPU tensor, where this shape is vLLM's CPU backend's (see
      :func:`detect_layout`).
    - ``MLA``: ``[nb, bs, latent]``, one latent per token (``H`` = 1, ``D`` = latent); vLLM
      0.32 hands it over as ``[nb, 1, bs, latent]``, which reads the same.
    """

    FLASH_NHD = "flash_nhd"
    FLASH_HND = "flash_hnd"
    FLASHINFER = "flashinfer"
    CPU = "cpu"
    CPU_KT = "cpu_kt"
    CPU_AMX = "cpu_amx"
    PACKED = "packed"
    MLA = "mla"


# The vLLM CPU layouts: one shape ([num_blocks, heads, block_size, 2*head_size]), three orders inside it.
CPU_LAYOUTS = (CacheLayout.CPU, CacheLayout.CPU_KT, CacheLayout.CPU_AMX)
# The AMX tiles: 16 rows (tokens of K, dims of V) of pairs (VNNI: two 16-bit values per 32-bit word).
AMX_TILE_ROWS, AMX_PAIR = 16, 2


_PATTERNS = {
    CacheLayout.FLASH_NHD: "[2, num_blocks, block_size, num_kv_heads, head_size]",
    CacheLayout.FLASH_HND: "[2, num_blocks, num_kv_heads, block_size, head_size] (or its permuted view)",
    CacheLayout.FLASHINFER: "[num_blocks, 2, block_size, num_kv_heads, head_size]",
    CacheLayout.CPU: "[num_blocks, num_kv_heads, block_size, 2*head_size]",
    CacheLayout.CPU_KT: "[num_blocks, num_kv_heads, block_size, 2*head_size]",
    CacheLayout.CPU_AMX: "[num_blocks, num_kv_heads, block_size, 2*head_size], block_size and head_size multiples of 16",
    CacheLayout.PACKED: "[num_blocks, num_kv_heads, block_size, 2*head_size] (any memory order of the first three)",
    CacheLayout.MLA: "[num_blocks, block_size, latent] or [num_blocks, 1, block_size, latent]",
}


def _read_shape(tensor: torch.Tensor, layout: CacheLayout) -> tuple[int, ...]:
    """``tensor``'s shape as ``layout`` reads it: vLLM 0.32's MLA view ``[B, H=1, N, C]`` as ``[B, N, C]``."""
    shape = tuple(tensor.shape)
    if layout is CacheLayout.MLA and len(shape) == 4 and shape[1] == 1:
        return (shape[0], *shape[2:])
    return shape


def _hnd_is_physical(tensor: torch.Tensor) -> bool:
    """True when dims 2, 3 of an HND tensor are (heads, tokens), False for the permuted (tokens, heads) view."""
    if tensor.stride(2) != tensor.stride(3):
        return tensor.stride(2) > tensor.stride(3)
    return tensor.size(3) == 1  # equal strides happen only with block_size 1: the size-1 dim is the tokens


@dataclass(frozen=True, slots=True)
class PagedCacheSpec:
    """The geometry of one layer's paged KV cache tensor."""

    layout: CacheLayout
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.layout, CacheLayout):
            raise TypeError(f"PagedCacheSpec.layout must be a CacheLayout, got {self.layout!r}")
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PagedCacheSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"PagedCacheSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.layout is CacheLayout.CPU_AMX and (self.block_size % AMX_TILE_ROWS or self.head_size % AMX_TILE_ROWS):
            raise ValueError(f"a CPU_AMX cache packs 16-row tiles: block_size and head_size must be multiples of "
                             f"{AMX_TILE_ROWS}, got block_size={self.block_size}, head_size={self.head_size}")
        if self.layout is CacheLayout.MLA and self.num_kv_heads != 1:
            raise ValueError(f"an MLA cache holds one latent per token; num_kv_heads must be 1, got {self.num_kv_heads}")

    @property
    def use_mla(self) -> bool:
        return self.layout is CacheLayout.MLA

    @property
    def kv_parts(self) -> int:
        """2 for K and V, 1 for an MLA latent."""
        return 1 if self.use_mla else 2

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of a contiguous cache tensor of this layout (HND: the physical order)."""
        nb, bs, heads, dim, layout = self.num_blocks, self.block_size, self.num_kv_heads, self.head_size, self.layout
        if layout is CacheLayout.FLASH_NHD:
            return (2, nb, bs, heads, dim)
        if layout is CacheLayout.FLASH_HND:
            return (2, nb, heads, bs, dim)
        if layout is CacheLayout.FLASHINFER:
            return (nb, 2, bs, heads, dim)
        if layout in CPU_LAYOUTS or layout is CacheLayout.PACKED:
            return (nb, heads, bs, 2 * dim)
        return (nb, bs, dim)

    def wire_shape(self, num_tokens: int, num_heads: int) -> tuple[int, ...]:
        return wire_shape(num_tokens, num_heads, self.head_size, self.use_mla)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, layout: CacheLayout) -> PagedCacheSpec:
        """Read the geometry of ``tensor`` taken as ``layout``; ValueError naming expected vs actual."""
        shape = _read_shape(tensor, layout)
        four_dims = layout in CPU_LAYOUTS or layout is CacheLayout.PACKED
        ndim = 4 if four_dims else 3 if layout is CacheLayout.MLA else 5
        bad = len(shape) != ndim or any(size < 1 for size in shape)
        if not bad and layout in (CacheLayout.FLASH_NHD, CacheLayout.FLASH_HND):
            bad = shape[0] != 2
        elif not bad and layout is CacheLayout.FLASHINFER:
            bad = shape[1] != 2
        elif not bad and four_dims:
            bad = shape[3] % 2 != 0
        if bad:
            raise ValueError(f"a {layout.name} cache must be {_PATTERNS[layout]}, got shape {list(shape)}")
        if layout is CacheLayout.FLASH_NHD:
            nb, bs, heads, dim = shape[1:]
        elif layout is CacheLayout.FLASH_HND:
            nb, heads, bs, dim = shape[1:] if _hnd_is_physical(tensor) else (shape[1], shape[3], shape[2], shape[4])
        elif layout is CacheLayout.FLASHINFER:
            nb, _, bs, heads, dim = shape
        elif four_dims:
            nb, heads, bs, dim = shape[0], shape[1], shape[2], shape[3] // 2
        else:
            (nb, bs, dim), heads = shape, 1
        return cls(layout, nb, bs, heads, dim, tensor.dtype)


def wire_shape(num_tokens: int, num_heads: int, head_size: int, mla: bool) -> tuple[int, ...]:
    """The wire tensor of a slice: ``[2, tokens, heads, head_size]`` (K then V), MLA ``[1, tokens, latent]``."""
    if mla:
        if num_heads not in (0, 1):
            raise ValueError(f"an MLA slice has one latent per token; num_heads must be 1, got {num_heads}")
        return (1, num_tokens * num_heads, head_size)
    return (2, num_tokens, num_heads, head_size)


def _check_cpu_rows(cache: torch.Tensor, spec: PagedCacheSpec) -> None:
    dim = spec.head_size
    if cache.stride(3) != 1 or cache.stride(2) != 2 * dim:
        raise ValueError(
            f"a {spec.layout.name} cache needs contiguous [block_size, 2*head_size] rows, got strides {cache.stride()}"
        )


def _check_cache(cache: torch.Tensor, spec: PagedCacheSpec) -> None:
    if cache.dtype != spec.dtype:
        raise ShapeMismatchError(f"cache dtype is {cache.dtype}, spec says {spec.dtype}")
    hnd_view = spec.layout is CacheLayout.FLASH_HND and cache.dim() == 5 and not _hnd_is_physical(cache)
    if not hnd_view and _read_shape(cache, spec.layout) != spec.shape:
        raise ShapeMismatchError(
            f"{spec.layout.name} cache has shape {list(cache.shape)}, spec expects {list(spec.shape)}"
        )


def part_views(cache: torch.Tensor, spec: PagedCacheSpec) -> tuple[torch.Tensor, ...]:
    """One view per part (K, V; MLA: the latent) as ``[num_blocks, block_size, num_kv_heads, head_size]`` (no copy).

    Exists for every layout but CPU_AMX (see :func:`amx_views`), CPU_KT included (its
    keys and values have different strides, so :func:`kv_view` cannot stack them).
    Raises as :func:`kv_view`.
    """
    if spec.layout is CacheLayout.CPU_AMX:
        raise ValueError("a CPU_AMX cache has no [num_blocks, block_size, heads, head_size] view: its tokens and dims "
                         "are split across tiles; use amx_views")
    if spec.layout is not CacheLayout.CPU_KT:
        return tuple(kv_view(cache, spec).unbind(0))
    _check_cache(cache, spec)
    _check_cpu_rows(cache, spec)
    nb, heads, bs, dim = spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size
    halves = cache.view(nb, heads, 2, bs * dim)
    keys = halves[:, :, 0].unflatten(2, (dim, bs)).permute(0, 3, 1, 2)
    values = halves[:, :, 1].unflatten(2, (bs, dim)).permute(0, 2, 1, 3)
    return keys, values


def amx_views(cache: torch.Tensor, spec: PagedCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a CPU_AMX cache as token-major tile views (no copy).

    Keys ``[num_blocks, bs/16, 16, heads, D/2, 2]``: token ``16*i + j`` is ``[:, i, j]``,
    dim ``2*p + e`` is ``[..., p, e]``. Values ``[num_blocks, bs/2, 2, heads, D/16, 16]``:
    token ``2*i + e`` is ``[:, i, e]``, dim ``16*p + j`` is ``[..., p, j]``. Raises as
    :func:`kv_view` for a cache that does not match ``spec``.
    """
    if spec.layout is not CacheLayout.CPU_AMX:
        raise ValueError(f"amx_views reads CPU_AMX caches, the spec says {spec.layout.name}")
    _check_cache(cache, spec)
    _check_cpu_rows(cache, spec)
    nb, heads, bs, dim = spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size
    rows, pair = AMX_TILE_ROWS, AMX_PAIR
    halves = cache.view(nb, heads, 2, bs * dim)
    keys = halves[:, :, 0].unflatten(2, (bs // rows, dim // pair, rows, pair)).permute(0, 2, 4, 1, 3, 5)
    values = halves[:, :, 1].unflatten(2, (dim // rows, bs // pair, rows, pair)).permute(0, 3, 5, 1, 2, 4)
    return keys, values


def kv_view(cache: torch.Tensor, spec: PagedCacheSpec) -> torch.Tensor:
    """A view of ``cache`` as ``[parts, num_blocks, block_size, num_kv_heads, head_size]`` (no copy).

    ``parts`` is K, V (MLA: the latent, with one head). Raises ShapeMismatchError when
    ``cache`` does not match ``spec``, ValueError for CPU_KT (no such view: use
    :func:`part_views`).
    """
    _check_cache(cache, spec)
    layout = spec.layout
    if layout is CacheLayout.CPU_KT:
        raise ValueError(
            "a CPU_KT cache has no single [parts, ...] view: its keys are [head_size, block_size] per block "
            "and head, its values [block_size, head_size]; use part_views"
        )
    if layout is CacheLayout.CPU_AMX:
        raise ValueError("a CPU_AMX cache has no [parts, ...] view: its tokens and dims are split across tiles; "
                         "use amx_views")
    if layout is CacheLayout.FLASH_HND and cache.dim() == 5 and not _hnd_is_physical(cache):
        view = cache
    elif layout is CacheLayout.FLASH_NHD:
        view = cache
    elif layout is CacheLayout.FLASH_HND:
        view = cache.transpose(2, 3)
    elif layout is CacheLayout.FLASHINFER:
        view = cache.transpose(0, 1)
    elif layout is CacheLayout.CPU:
        _check_cpu_rows(cache, spec)
        nb, heads, bs, dim = spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size
        view = cache.view(nb, heads, 2, bs, dim).permute(2, 0, 3, 1, 4)
    elif layout is CacheLayout.PACKED:
        view = cache.unflatten(3, (2, spec.head_size)).permute(3, 0, 2, 1, 4)
    elif cache.dim() == 4:  # MLA as [nb, 1, bs, latent]
        view = cache.transpose(1, 2).unsqueeze(0)
    else:
        view = cache.unsqueeze(0).unsqueeze(3)
    expected = (spec.kv_parts, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    if tuple(view.shape) != expected:
        raise ShapeMismatchError(f"{layout.name} cache has shape {list(cache.shape)}, spec expects {list(spec.shape)}")
    return view


def detect_layout(
    tensor: torch.Tensor, num_kv_heads: int, head_size: int, block_size: int | None = None
) -> CacheLayout:
    """The layout of ``tensor`` when its shape (and, for HND, strides) allows only one reading.

    A ``[num_blocks, num_kv_heads, block_size, 2*head_size]`` tensor is what vLLM 0.32
    hands every attention backend; how K and V share its last dim depends on the
    backend, not the shape: it reads as ``PACKED`` (vLLM's GPU backends: K then V per
    token) on a GPU and as ``CPU`` (vLLM's CPU backend: K then V per block and head) on
    the CPU. Never answers CPU_KT or CPU_AMX, the CPU backend's other orders in the same
    shape: a caller whose keys may be transposed (vLLM's CPU kernels) must choose itself.
    Raises ValueError naming the shape when no layout fits or several read it differently.
    """
    on_cpu = tensor.device.type == "cpu"
    skipped = {CacheLayout.CPU_KT, CacheLayout.CPU_AMX, CacheLayout.PACKED if on_cpu else CacheLayout.CPU}
    fits: dict[CacheLayout, torch.Tensor] = {}
    for layout in CacheLayout:
        if layout in skipped:
            continue
        try:
            spec = PagedCacheSpec.from_tensor(tensor, layout)
        except ValueError:
            continue
        if (spec.num_kv_heads, spec.head_size) != (num_kv_heads, head_size):
            continue
        if block_size is not None and spec.block_size != block_size:
            continue
        try:
            fits[layout] = kv_view(tensor, spec)
        except ValueError:  # e.g. a CPU-shaped tensor whose rows are not contiguous
            continue
    if not fits:
        raise ValueError(
            f"no cache layout has shape {list(tensor.shape)} with num_kv_heads={num_kv_heads}, "
            f"head_size={head_size}, block_size={block_size}"
        )
    readings = {(tuple(v.shape), v.stride(), v.storage_offset()) for v in fits.values()}
    if len(fits) == 1:
        return next(iter(fits))
    if len(readings) == 1 and set(fits) == {CacheLayout.FLASH_NHD, CacheLayout.FLASH_HND}:
        # One reading, two names: name it after the memory order.
        view = fits[CacheLayout.FLASH_NHD]
        return CacheLayout.FLASH_HND if view.stride(3) > view.stride(2) else CacheLayout.FLASH_NHD
    names = ", ".join(layout.name for layout in fits)
    raise ValueError(f"cache shape {list(tensor.shape)} is ambiguous: it reads as {names}; pass the layout explicitly")
