"""Gather a request's slice of one layer's paged cache into the wire format, and scatter it back.

CPU caches go through the native kernel (``_kernel.c``): one memcpy per contiguous
run, a tiled transpose for CPU_KT keys, and for CPU_AMX (``copy_amx``) a transpose
of each 16-token key tile of element pairs and a de-interleave of value pairs. It
is the default because torch's copy kernels pay per indexed row and the vLLM CPU
layouts cut slices into rows of one head (see benchmarks/bench_paged.py). ``NCCLKV_PAGED_KERNEL=torch`` or
``kernel="torch"`` selects the torch-op path below for CPU caches too.

Torch-op path (CUDA caches, or asked for): whole blocks move with
one ``index_select`` / ``index_copy_`` over the block dim of each part (K, V) as a
4-D view; dim 0 is the fast path of both ops, indexing another dim is about 10x
slower. Both views are reinterpreted with the widest integer dtype their strides
allow, so the copy moves 8-byte words instead of 2-byte elements. The partial
first and last blocks are one strided ``copy_`` each. CPU_KT keys (``[D, bs]`` per
block and head) cannot be widened and need a transpose: whole blocks go through
an L2-sized bounce buffer in their own order (indexed copy of contiguous rows),
then one batched transposing ``copy_``; that transpose bounds them to a few GB/s.
CPU_AMX goes through its 6-d tile views (:func:`amx_views`): one indexed copy per
part for whole blocks, a strided copy per key tile and value pair run at the edges.
Only torch ops run here, so the same code runs on CUDA tensors, asynchronously on
the current stream.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .._env import PAGED_KERNELS, env_settings
from ..errors import ShapeMismatchError
from ..layout import Span
from ._native import move_amx, move_parts, part_geometry
from ._slots import BlockRun, SlicePlan, SlotMap
from ._spec import AMX_PAIR, AMX_TILE_ROWS, CacheLayout, PagedCacheSpec, amx_views, part_views

__all__ = ["CacheViews", "cache_views", "gather", "scatter"]

# The widest word of each size; complex128 is only a 16-byte word here: every op below moves it without arithmetic.
_WIDE_DTYPES = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16}
# CPU_KT keys pass through a bounce buffer of about this size (L2-sized: both passes hit cache).
_BOUNCE_BYTES = 512 * 1024


def _widen(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of ``tensors`` (one dtype) as the widest word all their strides and alignments allow.

    Bytes are moved unchanged, so this is exact for every dtype; it only cuts the
    number of elements the indexed copies walk (``index_copy_`` costs per element:
    16-byte words run it about 2x faster than 8-byte ones on CPU). The word is the
    largest power of two up to 16 bytes that divides every tensor's last dim, other
    strides, offset and address (one gcd: the per-layer call's host time counts on CUDA).
    """
    itemsize = tensors[0].element_size()
    word = 16
    for t in tensors:
        if t.stride(-1) != 1:
            return tensors
        word = math.gcd(word, t.size(-1) * itemsize, t.storage_offset() * itemsize, t.data_ptr(),
                        *(stride * itemsize for stride in t.stride()[:-1]))
    if word <= itemsize:
        return tensors
    wide = _WIDE_DTYPES[word]
    return tuple(t.view(wide) for t in tensors)


@functools.cache
def _default_kernel() -> str:
    return env_settings().paged_kernel  # read once: gather runs per layer


def _use_native(kernel: str | None, cache: torch.Tensor, spec: PagedCacheSpec) -> bool:
    """Whether this call takes the native kernel (CPU caches); ValueError names a bad ``kernel``."""
    if kernel is None:
        kernel = _default_kernel()
    elif kernel not in PAGED_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(PAGED_KERNELS)} or None, got {kernel!r}")
    return kernel == "native" and cache.device.type == "cpu"


def _as_slot_map(blocks: SlotMap | Sequence[int] | torch.Tensor, spec: PagedCacheSpec) -> SlotMap:
    if isinstance(blocks, SlotMap):
        if blocks.block_size != spec.block_size:
            raise ValueError(f"SlotMap has block_size {blocks.block_size}, the cache has {spec.block_size}")
        return blocks
    return SlotMap(blocks, spec.block_size)


_Part = tuple[torch.Tensor, torch.Tensor]  # (cache part [nb, bs, h, D'], wire part [T, h, D'])


def _check(
    cache: torch.Tensor,
    spec: PagedCacheSpec,
    blocks: SlotMap | Sequence[int] | torch.Tensor,
    tokens: Span,
    heads: Span,
    wire: torch.Tensor,
    wire_name: str,
) -> tuple[SlicePlan, SlotMap]:
    """Check every argument but the cache itself (the views check it); return the plan and the slot map."""
    if not isinstance(tokens, Span) or not isinstance(heads, Span):
        raise TypeError(f"tokens and heads must be Span, got {type(tokens).__name__}, {type(heads).__name__}")
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
    slot_map = _as_slot_map(blocks, spec)
    plan = slot_map.plan(tokens, cache.device)
    if plan.max_block_id >= spec.num_blocks:
        raise ValueError(f"block id {plan.max_block_id} is out of range for a cache of {spec.num_blocks} blocks")
    return plan, slot_map


@dataclass(frozen=True, slots=True)
class CacheViews:
    """The cache side of the torch-op path for one cache and head span, made once by :func:`cache_views`.

    gather and scatter otherwise rebuild these views on every call: about half of a
    call's host time, and host time is what bounds a CUDA gather of a few MiB (70-88 us
    a call against 12-28 us of GPU time on an H100). Holding them holds the cache's memory.
    """

    key: tuple[int, PagedCacheSpec, Span]  # (cache address, spec, heads) they were made for
    parts: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per part (K, V): (narrow view, widest view)


def cache_views(cache: torch.Tensor, spec: PagedCacheSpec, heads: Span) -> CacheViews:
    """The views :func:`gather` and :func:`scatter` take as ``views`` for ``cache``'s heads ``heads``.

    Raises as :func:`part_views` (CPU_AMX has none: its calls need no views).
    """
    narrow = [view[:, :, heads.start : heads.stop] for view in part_views(cache, spec)]
    return CacheViews((cache.data_ptr(), spec, heads), tuple((view, _widen(view)[0]) for view in narrow))


def _torch_parts(cache: torch.Tensor, spec: PagedCacheSpec, tokens: Span, heads: Span, wire: torch.Tensor,
                 views: CacheViews | None = None) -> list[_Part]:
    """Per part (K, V) the cache view and the wire view, widened alike.

    ``D'`` is the head size in wide words (a CPU_KT key part, whose head dim is
    strided, stays narrow). ``views`` (from :func:`cache_views`) spares remaking the
    cache side; the wire is contiguous, so it takes the cached word when its address does.
    """
    wire4 = wire.view(spec.kv_parts, len(tokens), len(heads), spec.head_size)
    parts: list[_Part] = []
    if views is not None:
        if views.key != (cache.data_ptr(), spec, heads):
            raise ValueError(f"views were made for {views.key}, not this cache's {(cache.data_ptr(), spec, heads)}")
        for (narrow, wide), wire_part in zip(views.parts, wire4.unbind(0)):
            ratio = wide.element_size() // narrow.element_size()
            if ratio > 1 and wire_part.data_ptr() % wide.element_size() == 0:
                parts.append((wide, wire_part.view(wide.dtype)))
            else:
                parts.append(_widen(narrow, wire_part))  # type: ignore[arg-type]
        return parts
    for view, wire_part in zip(part_views(cache, spec), wire4.unbind(0)):
        cache_part, wire_part = _widen(view[:, :, heads.start : heads.stop], wire_part)
        parts.append((cache_part, wire_part))
    return parts


def _token_minor(part: torch.Tensor) -> bool:
    """True for a CPU_KT key part ``[nb, bs, h, D]``: per (block, head) the tokens are the contiguous dim."""
    return part.size(1) > 1 and part.stride(1) == 1 and part.stride(3) != 1


def _steps(num_full: int, part: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, stop)`` block ranges for the transposed path, so its bounce buffer stays in cache."""
    block_bytes = part[0].numel() * part.element_size()
    step = max(1, _BOUNCE_BYTES // block_bytes)
    return [(start, min(num_full, start + step)) for start in range(0, num_full, step)]


_scratch = threading.local()  # per thread: gather and scatter run on several threads at once


def _bounce(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A scratch tensor of ``shape`` with ``like``'s dtype and device, reused across calls on this thread.

    The bounce buffer is L2-sized and needed on every layer of a CPU_KT transfer: keeping it
    keeps the allocator off the hot path."""
    # CUDA work is queued per stream: a buffer shared by two streams could be overwritten early.
    stream = torch.cuda.current_stream(like.device).cuda_stream if like.device.type == "cuda" else 0
    key = (like.dtype, like.device, stream)
    buffers: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    numel = 1
    for size in shape:
        numel *= size
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        # A normal tensor even when made under inference mode (vLLM's forward): an inference
        # tensor could not be written outside it, and the same thread may gather in both.
        with torch.inference_mode(False):
            buffer = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel].view(shape)


def _gather_blocks(part: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[i] = part[index[i]]`` for whole blocks; ``dst`` is ``[n, bs, h, D']``, contiguous."""
    if not _token_minor(part):
        torch.index_select(part, 0, index, out=dst)
        return
    # Whole blocks in their own [h, D, bs] order first (an indexed copy of contiguous
    # rows), then one batched transpose into the wire, a cache-sized chunk at a time.
    num, bs, heads, dim = dst.shape
    (natural,) = _widen(part.permute(0, 2, 3, 1))  # [nb, h, D, bs]
    for start, stop in _steps(num, part):
        bounce = _bounce((stop - start, *natural.shape[1:]), natural)
        torch.index_select(natural, 0, index[start:stop], out=bounce)
        rows = bounce.view(part.dtype).view(stop - start, heads * dim, bs).transpose(1, 2)
        dst[start:stop].view(stop - start, bs, heads * dim).copy_(rows)


def _scatter_blocks(src: torch.Tensor, part: torch.Tensor, index: torch.Tensor) -> None:
    """``part[index[i]] = src[i]`` for whole blocks; ``src`` is ``[n, bs, h, D']``, contiguous."""
    if not _token_minor(part):
        part.index_copy_(0, index, src)
        return
    num, bs, heads, dim = src.shape
    natural = part.permute(0, 2, 3, 1)  # [nb, h, D, bs]
    steps = _steps(num, part)
    bounce = _bounce((steps[0][1], heads, dim, bs), part)
    for start, stop in steps:
        chunk = bounce[: stop - start]
        rows = src[start:stop].view(stop - start, bs, heads * dim).transpose(1, 2)
        chunk.view(stop - start, heads * dim, bs).copy_(rows)
        wide_natural, wide_chunk = _widen(natural, chunk)
        wide_natural.index_copy_(0, index[start:stop], wide_chunk)


def gather(
    cache: torch.Tensor,
    spec: PagedCacheSpec,
    block_ids: SlotMap | Sequence[int] | torch.Tensor,
    tokens: Span,
    heads: Span,
    out: torch.Tensor,
    kernel: str | None = None,
    views: CacheViews | None = None,
) -> torch.Tensor:
    """Copy tokens ``tokens`` (request-relative) x kv heads ``heads`` of one layer into ``out``; return ``out``.

    ``out`` is the contiguous wire tensor, ``spec.wire_shape(len(tokens), len(heads))``,
    of the cache dtype and on the cache's device. Pass a :class:`SlotMap` built
    once per request to avoid rebuilding index tensors on every layer.
    ``kernel`` is ``"native"`` or ``"torch"`` for CPU caches (None: NCCLKV_PAGED_KERNEL);
    CUDA caches always take torch ops. ``views``: :func:`cache_views` of ``cache`` and
    ``heads``, for a caller that moves many slices of one cache (the torch ops only).
    """
    plan, slot_map = _check(cache, spec, block_ids, tokens, heads, out, "out")
    move = _mover(cache, spec, plan, slot_map, tokens, heads, out, kernel, views)
    if len(tokens) and len(heads):
        move(True)
    return out


def scatter(
    wire: torch.Tensor,
    cache: torch.Tensor,
    spec: PagedCacheSpec,
    block_ids: SlotMap | Sequence[int] | torch.Tensor,
    tokens: Span,
    heads: Span,
    kernel: str | None = None,
    views: CacheViews | None = None,
) -> None:
    """Write the wire tensor ``wire`` into tokens ``tokens`` x local kv heads ``heads`` of one layer's cache.

    The inverse of :func:`gather`; the cache may have another layout and block
    size than the one the slice was gathered from. The blocks the span touches
    must be distinct. ``kernel`` and ``views`` as for :func:`gather`.
    """
    plan, slot_map = _check(cache, spec, block_ids, tokens, heads, wire, "wire")
    move = _mover(cache, spec, plan, slot_map, tokens, heads, wire, kernel, views)
    if len(tokens) == 0 or len(heads) == 0:
        return
    if not plan.distinct:
        raise ValueError(f"token span {tokens!r} maps to repeated block ids {slot_map.repeated(tokens)[:8]}; scatter "
                         "needs distinct blocks")
    move(False)


def _mover(cache: torch.Tensor, spec: PagedCacheSpec, plan: SlicePlan, slot_map: SlotMap, tokens: Span, heads: Span,
           wire: torch.Tensor, kernel: str | None, views: CacheViews | None) -> Callable[[bool], None]:
    """Check ``cache`` for this call (even for an empty span) and return ``move(to_wire)``: the gather
    (``to_wire``) or scatter of the span through the layout's and the kernel's path."""
    native = _use_native(kernel, cache, spec)
    if spec.layout is CacheLayout.CPU_AMX:
        tiles = amx_views(cache, spec)
        if native:
            return lambda to_wire: move_amx(to_wire, cache, spec, slot_map._kernel_ids, tokens, heads, wire)
        return lambda to_wire: _amx_move(to_wire, tiles, spec, plan, heads, wire)
    if native:
        geometry = part_geometry(cache, spec, heads)
        return lambda to_wire: move_parts(to_wire, cache, geometry, spec, slot_map._kernel_ids, tokens, heads, wire)
    parts = _torch_parts(cache, spec, tokens, heads, wire, views)
    return lambda to_wire: _torch_move(to_wire, parts, spec, plan)


def _torch_move(to_wire: bool, parts: list[_Part], spec: PagedCacheSpec, plan: SlicePlan) -> None:
    """Torch ops, per part: a copy per partial-block run, one indexed copy of the whole blocks."""
    for view, wire in parts:
        for run in plan.edges:
            at = slice(run.wire_start, run.wire_start + run.length)
            cached = view[run.block_id, run.offset : run.offset + run.length]
            if to_wire:
                wire[at].copy_(cached)
            else:
                cached.copy_(wire[at])
        if plan.block_index is not None:
            num_full = len(plan.full_block_ids)
            full = wire[plan.full_start : plan.full_start + num_full * spec.block_size]
            full = full.unflatten(0, (num_full, spec.block_size))
            if to_wire:
                _gather_blocks(view, plan.block_index, full)
            else:
                _scatter_blocks(full, view, plan.block_index)


def _amx_move(to_wire: bool, tiles: tuple[torch.Tensor, torch.Tensor], spec: PagedCacheSpec, plan: SlicePlan,
              heads: Span, wire: torch.Tensor) -> None:
    """Gather (``to_wire``) or scatter one layer's slice of a CPU_AMX cache through its tile views (``tiles``:
    :func:`amx_views` of the cache).

    Whole blocks move with one indexed copy per part; a partial block's tokens
    with one strided copy per 16-token key tile and per run of value token pairs
    (an odd first or last token alone), so no token outside the span is written.
    """
    keys, values = (view[:, :, :, heads.start : heads.stop] for view in tiles)
    wire_keys, wire_values = wire[0], wire[1]  # [tokens, heads, head_size]
    for run in plan.edges:
        for cached, wired in _amx_edge(keys, values, wire_keys, wire_values, run, spec.head_size):
            (wired if to_wire else cached).copy_(cached if to_wire else wired)
    if plan.block_index is not None:
        num_full, bs, dim = len(plan.full_block_ids), spec.block_size, spec.head_size
        rows = slice(plan.full_start, plan.full_start + num_full * bs)
        full_keys = wire_keys[rows].unflatten(-1, (dim // AMX_PAIR, AMX_PAIR)).unflatten(
            0, (num_full, bs // AMX_TILE_ROWS, AMX_TILE_ROWS))
        full_values = wire_values[rows].unflatten(-1, (dim // AMX_TILE_ROWS, AMX_TILE_ROWS)).unflatten(
            0, (num_full, bs // AMX_PAIR, AMX_PAIR))
        for part, full in ((keys, full_keys), (values, full_values)):
            if to_wire:
                torch.index_select(part, 0, plan.block_index, out=full)
            else:
                part.index_copy_(0, plan.block_index, full)


def _amx_edge(keys: torch.Tensor, values: torch.Tensor, wire_keys: torch.Tensor, wire_values: torch.Tensor,
              run: BlockRun, dim: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(cache view, wire view) pairs covering the tokens of one partial-block run, K then V."""
    block, start, stop = run.block_id, run.offset, run.offset + run.length
    first_row = run.wire_start - run.offset  # the wire row of the block's token 0
    token = start
    while token < stop:
        tile, low = divmod(token, AMX_TILE_ROWS)
        high = min(AMX_TILE_ROWS, low + stop - token)
        at = first_row + token
        yield keys[block, tile, low:high], wire_keys[at : at + high - low].unflatten(-1, (dim // AMX_PAIR, AMX_PAIR))
        token += high - low
    token = start
    if token % AMX_PAIR:  # the second token of a pair
        yield values[block, token // AMX_PAIR, 1], wire_values[first_row + token].unflatten(-1, (-1, AMX_TILE_ROWS))
        token += 1
    pairs = (stop - token) // AMX_PAIR
    if pairs:
        at = first_row + token
        wired = wire_values[at : at + AMX_PAIR * pairs].unflatten(0, (pairs, AMX_PAIR))
        yield values[block, token // AMX_PAIR : token // AMX_PAIR + pairs], wired.unflatten(-1, (-1, AMX_TILE_ROWS))
        token += AMX_PAIR * pairs
    if token < stop:  # the first token of a pair
        yield values[block, token // AMX_PAIR, 0], wire_values[first_row + token].unflatten(-1, (-1, AMX_TILE_ROWS))
