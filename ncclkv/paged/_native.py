"""The native CPU kernel (``_kernel.c``): one call moves a token span of one cache part.

Every argument is checked here or by the caller (``_copy._prepare``) before a raw
pointer reaches C: the views are CPU tensors, the wire part is contiguous, and
the plan has proved every block id in range.
"""

from __future__ import annotations

import torch

from . import _kernel  # type: ignore[attr-defined]  # built by setup.py

__all__ = ["copy_part"]


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
    if part.device.type != "cpu" or wire.device.type != "cpu":
        raise ValueError(f"the native kernel runs on CPU tensors, got {part.device} and {wire.device}")
    if part.dtype != wire.dtype:
        raise ValueError(f"part is {part.dtype}, wire is {wire.dtype}")
    if not wire.is_contiguous() or wire.dim() != 3 or tuple(wire.shape[1:]) != tuple(part.shape[2:]):
        raise ValueError(f"wire part must be contiguous [tokens, {part.size(2)}, {part.size(3)}], got {list(wire.shape)}")
    if block_ids.dtype != torch.int64 or block_ids.device.type != "cpu" or not block_ids.is_contiguous():
        raise ValueError(f"block_ids must be a contiguous int64 CPU tensor, got {block_ids.dtype} on {block_ids.device}")
    num_tokens = wire.size(0)
    if token_start + num_tokens > block_ids.numel() * block_size:
        raise ValueError(
            f"tokens [{token_start}, {token_start + num_tokens}) run past {block_ids.numel()} blocks of {block_size}"
        )
    elem = part.element_size()
    s_block, s_token, s_head, s_dim = (stride * elem for stride in part.stride())
    _kernel.copy_part(
        int(gather),
        part.data_ptr(),
        s_block,
        s_token,
        s_head,
        s_dim,
        elem,
        part.size(3),
        part.size(2),
        block_ids.data_ptr(),
        block_size,
        token_start,
        num_tokens,
        wire.data_ptr(),
    )
