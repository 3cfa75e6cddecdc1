"""The native CPU kernel (``_kernel.c``): one call moves a token span of every part of one layer.

Every argument is checked before a raw pointer reaches C (each tensor's storage holds what its shape and
strides reach, at every call): for
:func:`move_parts` and :func:`move_amx` by the caller (``_copy._check`` and
:func:`part_geometry`: the cache matches its spec, the wire is contiguous, and
every block id the span uses is in range); :func:`copy_part` checks its own,
block ids included.
"""

from __future__ import annotations

import os
import threading

import torch

from .._env import MAX_COPY_THREADS, env_settings
from ..layout import Span
from . import _kernel  # type: ignore[attr-defined]  # built by setup.py
from ._spec import PagedCacheSpec, part_views

__all__ = ["copy_part", "move_amx", "move_parts", "part_geometry", "set_copy_threads"]

_threads_chosen = False  # set_copy_threads ran: NCCLKV_COPY_THREADS no longer applies
_threads_lock = threading.Lock()  # the choice and the kernel's number change together


def _lock_anew_in_child() -> None:  # a fork while another thread held the lock would leave it held for good
    global _threads_lock
    _threads_lock = threading.Lock()


os.register_at_fork(after_in_child=_lock_anew_in_child)


def set_copy_threads(threads: int) -> int:
    """Let one native gather or scatter use up to ``threads`` threads (1-16); return the previous number.

    The slice is cut at block boundaries, at least 256 KiB a thread, so small
    slices stay on the caller's thread. More threads help where a transfer's
    copies have cores to themselves (the 16-core machine in
    benchmarks/RESULTS.md); on a host whose cores run the model they compete
    with it. Default: ``NCCLKV_COPY_THREADS``, else 1. Process-wide.
    """
    global _threads_chosen
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= MAX_COPY_THREADS:
        raise ValueError(f"copy threads must be an int in 1..{MAX_COPY_THREADS}, got {threads!r}")
    with _threads_lock:
        _threads_chosen = True
        return int(_kernel.set_threads(threads))


def _threads_from_env() -> None:
    global _threads_chosen
    if not _threads_chosen:  # read at the first copy, not at import: a bad variable fails the copy that needs it
        threads = env_settings().copy_threads
        with _threads_lock:
            if not _threads_chosen:  # a set_copy_threads while the variable was read stands
                _threads_chosen = True
                _kernel.set_threads(threads)

# (byte offset from the cache's data_ptr to the part's first element, byte strides [block, token, head, dim])
_Geometry = tuple[tuple[int, tuple[int, ...]], ...]
_GEOMETRIES: dict[tuple[object, ...], _Geometry] = {}
_MAX_GEOMETRIES = 1024  # a model has one or two cache geometries per layer kind; this only bounds misuse


def _check_storage(tensor: torch.Tensor, what: str) -> None:
    """The bytes ``tensor``'s shape and strides reach lie inside its storage: C gets raw pointers, and a
    storage resized under a tensor (``untyped_storage().resize_``) would be read or written past its end
    (torch's own ops check this at every view; the kernel's cached geometry does not)."""
    if tensor.numel() == 0:
        return
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    reach, held = (last + 1) * tensor.element_size(), tensor.untyped_storage().nbytes()
    if reach > held:
        raise ValueError(f"{what} {list(tensor.shape)} reaches {reach} bytes into its storage, which holds {held}")


def part_geometry(cache: torch.Tensor, spec: PagedCacheSpec, heads: Span) -> _Geometry:
    """Where each part (K, V; MLA: the latent) of ``cache``'s heads ``heads`` lies, in bytes (cached).

    Every layer of a model has the same geometry, so the views (and the checks in
    :func:`part_views`, which raise for a cache that does not match ``spec``) run
    once; a layer's gather is then pointer arithmetic.
    """
    key = (spec, cache.dtype, tuple(cache.shape), cache.stride(), heads.start, heads.stop)
    found = _GEOMETRIES.get(key)
    if found is not None:
        return found
    elem = cache.element_size()
    geometry = tuple(
        (view.data_ptr() - cache.data_ptr() + heads.start * view.stride(2) * elem, tuple(x * elem for x in view.stride()))
        for view in part_views(cache, spec)
    )
    if len(_GEOMETRIES) >= _MAX_GEOMETRIES:
        _GEOMETRIES.clear()
    _GEOMETRIES[key] = geometry
    return geometry


def move_parts(
    gather: bool,
    cache: torch.Tensor,
    geometry: _Geometry,
    spec: PagedCacheSpec,
    block_ids: torch.Tensor,
    tokens: Span,
    heads: Span,
    wire: torch.Tensor,
) -> None:
    """Every part of one layer's slice, cache -> wire (``gather``) or back.

    The caller has checked the wire (shape, dtype, CPU, contiguous) and that the
    span's blocks exist; ``geometry`` is :func:`part_geometry` of ``cache`` and
    ``heads``; ``block_ids`` is the request's contiguous int64 CPU table.
    """
    _check_storage(cache, "cache")
    _check_storage(wire, "wire")
    _threads_from_env()
    elem = cache.element_size()
    base, wire_ptr = cache.data_ptr(), wire.data_ptr()
    part_bytes = len(tokens) * len(heads) * spec.head_size * elem
    args = [int(gather), elem, spec.head_size, len(heads), block_ids.data_ptr(), spec.block_size, tokens.start, len(tokens)]
    for index, (offset, strides) in enumerate(geometry):
        args += [base + offset, *strides, wire_ptr + index * part_bytes]
    _kernel.copy_parts(*args)


def move_amx(gather: bool, cache: torch.Tensor, spec: PagedCacheSpec, block_ids: torch.Tensor, tokens: Span,
             heads: Span, wire: torch.Tensor) -> None:
    """One layer's slice of a CPU_AMX cache, cache -> wire (``gather``) or back.

    The caller has checked the cache (``amx_views``: contiguous ``[bs, 2*D]`` rows per
    block and head, bs and D multiples of 16), the wire and the span's blocks.
    """
    _check_storage(cache, "cache")
    _check_storage(wire, "wire")
    _threads_from_env()
    elem = cache.element_size()
    keys = cache.data_ptr() + heads.start * cache.stride(1) * elem
    wire_part = len(tokens) * len(heads) * spec.head_size * elem
    _kernel.copy_amx(int(gather), elem, spec.head_size, len(heads), block_ids.data_ptr(), spec.block_size,
                     tokens.start, len(tokens), keys, keys + spec.block_size * spec.head_size * elem,
                     cache.stride(0) * elem, cache.stride(1) * elem, wire.data_ptr(), wire.data_ptr() + wire_part)


def copy_part(
    gather: bool,
    part: torch.Tensor,
    wire: torch.Tensor,
    block_ids: torch.Tensor,
    block_size: int,
    token_start: int,
) -> None:
    """Move wire tokens ``[0, len(wire))``, request positions from ``token_start`` on, between ``part`` and ``wire``.

    ``part`` is one part's ``[num_blocks, block_size, heads, head_size]`` view (heads
    already sliced), ``wire`` the contiguous ``[tokens, heads, head_size]`` wire part
    of the same dtype, ``block_ids`` the request's int64 block table on the CPU.
    ``gather`` copies cache -> wire, else wire -> cache.
    """
    if part.dim() != 4:
        raise ValueError(f"part must be [num_blocks, block_size, heads, head_size], got {list(part.shape)}")
    if block_size != part.size(1) or block_size < 1:
        # the kernel indexes blocks by block_size; any other value walks off the part's blocks
        raise ValueError(f"block_size must be the part's {part.size(1)} (at least 1), got {block_size}")
    if token_start < 0:
        raise ValueError(f"token_start must be >= 0, got {token_start}")
    if part.device.type != "cpu" or wire.device.type != "cpu":
        raise ValueError(f"the native kernel runs on CPU tensors, got {part.device} and {wire.device}")
    if part.dtype != wire.dtype:
        raise ValueError(f"part is {part.dtype}, wire is {wire.dtype}")
    if not wire.is_contiguous() or wire.dim() != 3 or tuple(wire.shape[1:]) != tuple(part.shape[2:]):
        raise ValueError(f"wire part must be contiguous [tokens, {part.size(2)}, {part.size(3)}], got {list(wire.shape)}")
    if (block_ids.dtype != torch.int64 or block_ids.device.type != "cpu" or not block_ids.is_contiguous()
            or block_ids.dim() != 1):
        raise ValueError(f"block_ids must be a contiguous 1-D int64 CPU tensor, got {block_ids.dtype} "
                         f"{list(block_ids.shape)} on {block_ids.device}")
    for tensor, what in ((part, "part"), (wire, "wire"), (block_ids, "block_ids")):
        _check_storage(tensor, what)
    num_tokens = wire.size(0)
    if token_start + num_tokens > block_ids.numel() * block_size:
        raise ValueError(
            f"tokens [{token_start}, {token_start + num_tokens}) run past {block_ids.numel()} blocks of {block_size}"
        )
    if num_tokens:
        # only the span's blocks are read; C trusts them, so an id outside the part would be a wild pointer
        used = block_ids[token_start // block_size:(token_start + num_tokens - 1) // block_size + 1]
        bad = ((used < 0) | (used >= part.size(0))).nonzero()
        if bad.numel():
            index = token_start // block_size + int(bad[0])
            raise ValueError(
                f"block_ids[{index}] = {int(block_ids[index])} is outside the part's {part.size(0)} blocks"
            )
    _threads_from_env()
    elem = part.element_size()
    _kernel.copy_parts(
        int(gather), elem, part.size(3), part.size(2), block_ids.data_ptr(), block_size, token_start, num_tokens,
        part.data_ptr(), *(stride * elem for stride in part.stride()), wire.data_ptr(),
    )
