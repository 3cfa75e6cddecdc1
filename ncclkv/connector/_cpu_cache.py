"""vLLM's CPU KV cache as its attention kernels really store it.

The CPU cache tensor is ``[num_blocks, heads, block_size, 2*head_size]`` and,
per (block, head), holds the keys in the first half and the values in the
second. The values are ``[block_size, head_size]`` (token-major), but with the
portable SIMD kernels (ISA ``vec``, the float32 path) the keys are stored
transposed, ``[head_size, block_size]``: a whole block reads back right
whatever the order, a slice of one does not. :func:`cpu_key_order` asks
vLLM's own cache-write op where one block's keys land, and
:class:`TransposedKeyCopier` gathers and scatters that order for the engine.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..engine import CacheCopier
from ..layout import Span
from ..paged import CacheLayout, PagedCacheSpec, SlotMap

__all__ = ["TransposedKeyCopier", "cache_copier", "cpu_key_order"]

KeyOrder = Literal["token_major", "transposed"]


def cpu_key_order(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> KeyOrder:
    """Write one block with vLLM's CPU cache op and read back the order of its keys and values.

    Raises NotImplementedError naming the ISA when the values are not token-major
    or the keys neither token-major nor transposed.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    tok = torch.arange(block_size).view(block_size, 1, 1).expand(block_size, 1, head_size)
    dim = torch.arange(head_size).remainder(128).view(1, 1, head_size).expand(block_size, 1, head_size)
    seen = []
    for probe in (tok, dim):  # small integers: exact in every float dtype
        cache = torch.zeros(1, 1, 2 * block_size, head_size, dtype=dtype)
        keys, values = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(probe.to(dtype).contiguous(), (probe + 1).to(dtype).contiguous(), keys,
                                       values, torch.arange(block_size), isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype=kv_cache_dtype)
        seen.append((keys.reshape(-1).float(), values.reshape(-1).float()))
    token_major = [p[:, 0, :].reshape(-1).float() for p in (tok, dim)]
    transposed = [p[:, 0, :].t().reshape(-1).float() for p in (tok, dim)]
    if not all(torch.equal(v, t + 1) for (_, v), t in zip(seen, token_major)):
        raise NotImplementedError(f"vLLM CPU attention (ISA {isa!r}) stores values in an order ncclkv does not read")
    if all(torch.equal(k, t) for (k, _), t in zip(seen, token_major)):
        return "token_major"
    if all(torch.equal(k, t) for (k, _), t in zip(seen, transposed)):
        return "transposed"
    raise NotImplementedError(f"vLLM CPU attention (ISA {isa!r}) stores keys in an order ncclkv does not read")


def cache_copier(cache: torch.Tensor, layout: CacheLayout, block_size: int, head_size: int,
                 kv_cache_dtype: str = "auto") -> CacheCopier | None:
    """The engine's gather/scatter for this cache: ours when vLLM's CPU kernels store keys transposed,
    None (ncclkv.paged's) for every other layout."""
    if layout is not CacheLayout.CPU or cache.device.type != "cpu":
        return None
    order = cpu_key_order(cache.dtype, block_size, head_size, kv_cache_dtype)
    return TransposedKeyCopier() if order == "transposed" else None


def _runs(slots: SlotMap, tokens: Span) -> list[tuple[int, int, int, int]]:
    """(block id, offset in block, length, offset in the wire) for each block ``tokens`` touch."""
    size, out = slots.block_size, []
    start = tokens.start
    while start < tokens.stop:
        index, offset = divmod(start, size)
        length = min(size - offset, tokens.stop - start)
        out.append((slots.block_ids[index], offset, length, start - tokens.start))
        start += length
    return out


def _halves(cache: torch.Tensor, spec: PagedCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``keys[block, head, dim, token]`` and ``values[block, head, token, dim]`` of a CPU cache."""
    nb, heads, bs, dim = spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size
    if cache.stride(3) != 1 or cache.stride(2) != 2 * dim:
        raise ValueError(f"a CPU cache needs contiguous [block_size, 2*head_size] rows, got strides {cache.stride()}")
    flat = cache.view(nb, heads, 2 * bs * dim)
    return flat[:, :, :bs * dim].unflatten(2, (dim, bs)), flat[:, :, bs * dim:].unflatten(2, (bs, dim))


class TransposedKeyCopier:
    """``gather`` / ``scatter`` (as in :mod:`ncclkv.paged`) for a CPU cache with keys ``[head_size, block_size]``."""

    @staticmethod
    def gather(cache: torch.Tensor, spec: PagedCacheSpec, slots: SlotMap, tokens: Span, heads: Span,
               out: torch.Tensor) -> torch.Tensor:
        keys, values = _halves(cache, spec)
        hs = slice(heads.start, heads.stop)
        for block, offset, length, at in _runs(slots, tokens):
            out[0, at:at + length].copy_(keys[block, hs, :, offset:offset + length].permute(2, 0, 1))
            out[1, at:at + length].copy_(values[block, hs, offset:offset + length].transpose(0, 1))
        return out

    @staticmethod
    def scatter(wire: torch.Tensor, cache: torch.Tensor, spec: PagedCacheSpec, slots: SlotMap, tokens: Span,
                heads: Span) -> None:
        keys, values = _halves(cache, spec)
        hs = slice(heads.start, heads.stop)
        for block, offset, length, at in _runs(slots, tokens):
            keys[block, hs, :, offset:offset + length].copy_(wire[0, at:at + length].permute(1, 2, 0))
            values[block, hs, offset:offset + length].copy_(wire[1, at:at + length].transpose(0, 1))
