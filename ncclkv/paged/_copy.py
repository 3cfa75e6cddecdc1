"""Gather a request's slice of one layer's paged cache into the wire format, and scatter it back.

Strategy (measured on CPU, see benchmarks/bench_paged.py): whole blocks move with
one ``index_select`` / ``index_copy_`` over the block dim of each part (K, V) as a
4-D view; dim 0 is the fast path of both ops, indexing another dim is about 10x
slower. Both views are reinterpreted with the widest integer dtype their strides
allow, so the copy moves 8-byte words instead of 2-byte elements. The partial
first and last blocks are one strided ``copy_`` each. Only torch ops run here, so
the same code runs on CUDA tensors, asynchronously on the current stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ShapeMismatchError
from ..layout import Span
from ._slots import SlicePlan, SlotMap
from ._spec import PagedCacheSpec, kv_view

__all__ = ["gather", "scatter"]

# complex128 is only a 16-byte word here: every op below moves it without arithmetic.
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16)


def _widen(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of ``a`` and ``b`` (same dtype and shape) as the widest word their strides and alignment allow.

    Bytes are moved unchanged, so this is exact for every dtype; it only cuts the
    number of elements the indexed copies walk (``index_copy_`` costs per element:
    16-byte words run it about 2x faster than 8-byte ones on CPU).
    """
    itemsize = a.element_size()
    for wide in _WIDE_DTYPES:
        ratio = wide.itemsize // itemsize
        if ratio <= 1:
            break
        if _can_view(a, ratio, wide.itemsize) and _can_view(b, ratio, wide.itemsize):
            return a.view(wide), b.view(wide)
    return a, b


def _can_view(t: torch.Tensor, ratio: int, align: int) -> bool:
    if t.stride(-1) != 1 or t.size(-1) % ratio or t.storage_offset() % ratio or t.data_ptr() % align:
        return False
    return all(stride % ratio == 0 for stride in t.stride()[:-1])


def _as_slot_map(blocks: SlotMap | Sequence[int] | torch.Tensor, spec: PagedCacheSpec) -> SlotMap:
    if isinstance(blocks, SlotMap):
        if blocks.block_size != spec.block_size:
            raise ValueError(f"SlotMap has block_size {blocks.block_size}, the cache has {spec.block_size}")
        return blocks
    return SlotMap(blocks, spec.block_size)


def _prepare(
    cache: torch.Tensor,
    spec: PagedCacheSpec,
    blocks: SlotMap | Sequence[int] | torch.Tensor,
    tokens: Span,
    heads: Span,
    wire: torch.Tensor,
    wire_name: str,
) -> tuple[torch.Tensor, torch.Tensor, SlicePlan]:
    """Check every argument; return the cache view ``[parts, nb, bs, h, D']``, the wire ``[parts, T, h, D']``, the plan.

    Both views are widened alike, so ``D'`` is the head size in wide words.
    """
    if not isinstance(tokens, Span) or not isinstance(heads, Span):
        raise TypeError(f"tokens and heads must be Span, got {type(tokens).__name__}, {type(heads).__name__}")
    view = kv_view(cache, spec)
    if heads.stop > spec.num_kv_heads:
        raise ValueError(f"head span {heads!r} is outside the cache's {spec.num_kv_heads} kv heads")
    expected = spec.wire_shape(len(tokens), len(heads))
    if tuple(wire.shape) != expected or wire.dtype != spec.dtype:
        raise ShapeMismatchError(
            f"{wire_name} is {wire.dtype} {list(wire.shape)}, expected {spec.dtype} {list(expected)} "
            f"for tokens {tokens!r}, heads {heads!r}"
        )
    if wire.device != cache.device:
        raise ValueError(f"{wire_name} is on {wire.device}, the cache on {cache.device}")
    if not wire.is_contiguous():
        raise ValueError(f"{wire_name} must be contiguous, got strides {wire.stride()}")
    plan = _as_slot_map(blocks, spec).plan(tokens, cache.device)
    if plan.max_block_id >= spec.num_blocks:
        raise ValueError(f"block id {plan.max_block_id} is out of range for a cache of {spec.num_blocks} blocks")
    wire4 = wire.view(spec.kv_parts, len(tokens), len(heads), spec.head_size)
    view, wire4 = _widen(view[:, :, :, heads.start : heads.stop], wire4)
    return view, wire4, plan


def gather(
    cache: torch.Tensor,
    spec: PagedCacheSpec,
    block_ids: SlotMap | Sequence[int] | torch.Tensor,
    tokens: Span,
    heads: Span,
    out: torch.Tensor,
) -> torch.Tensor:
    """Copy tokens ``tokens`` (request-relative) x kv heads ``heads`` of one layer into ``out``; return ``out``.

    ``out`` is the contiguous wire tensor, ``spec.wire_shape(len(tokens), len(heads))``,
    of the cache dtype and on the cache's device. Pass a :class:`SlotMap` built
    once per request to avoid rebuilding index tensors on every layer.
    """
    view, wire, plan = _prepare(cache, spec, block_ids, tokens, heads, out, "out")
    if len(tokens) == 0 or len(heads) == 0:
        return out
    for run in plan.edges:
        dst = wire[:, run.wire_start : run.wire_start + run.length]
        dst.copy_(view[:, run.block_id, run.offset : run.offset + run.length])
    if plan.block_index is not None:
        num_full = len(plan.full_block_ids)
        stop = plan.full_start + num_full * spec.block_size
        for part in range(spec.kv_parts):
            dst = wire[part, plan.full_start : stop].unflatten(0, (num_full, spec.block_size))
            torch.index_select(view[part], 0, plan.block_index, out=dst)
    return out


def scatter(
    wire: torch.Tensor,
    cache: torch.Tensor,
    spec: PagedCacheSpec,
    block_ids: SlotMap | Sequence[int] | torch.Tensor,
    tokens: Span,
    heads: Span,
) -> None:
    """Write the wire tensor ``wire`` into tokens ``tokens`` x local kv heads ``heads`` of one layer's cache.

    The inverse of :func:`gather`; the cache may have another layout and block
    size than the one the slice was gathered from. The blocks the span touches
    must be distinct.
    """
    view, wire4, plan = _prepare(cache, spec, block_ids, tokens, heads, wire, "wire")
    if len(tokens) == 0 or len(heads) == 0:
        return
    if not plan.distinct:
        used = list(plan.full_block_ids) + [run.block_id for run in plan.edges]
        repeated = sorted({b for b in used if used.count(b) > 1})
        raise ValueError(f"token span {tokens!r} maps to repeated block ids {repeated[:8]}; scatter needs distinct blocks")
    for run in plan.edges:
        src = wire4[:, run.wire_start : run.wire_start + run.length]
        view[:, run.block_id, run.offset : run.offset + run.length].copy_(src)
    if plan.block_index is not None:
        num_full = len(plan.full_block_ids)
        stop = plan.full_start + num_full * spec.block_size
        for part in range(spec.kv_parts):
            src = wire4[part, plan.full_start : stop].unflatten(0, (num_full, spec.block_size))
            view[part].index_copy_(0, plan.block_index, src)
