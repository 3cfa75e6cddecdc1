"""Which CPU layout vLLM's attention kernels really write: ``CacheLayout.CPU`` or ``CacheLayout.CPU_KT``.

The CPU cache tensor is ``[num_blocks, heads, block_size, 2*head_size]`` and,
per (block, head), holds the keys in the first half and the values in the
second. The values are ``[block_size, head_size]`` (token-major); the keys are
token-major too (``CPU``) or transposed, ``[head_size, block_size]``
(``CPU_KT``), depending on the ISA vLLM picks (``_get_attn_isa``): vLLM 0.32's
portable kernels (``vec``, ``vec16``) transpose them for every dtype. The shape
cannot tell the two apart, so :func:`cpu_key_order` writes one block with
vLLM's own cache-write op and reads back where the keys landed.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..paged import CacheLayout

__all__ = ["cpu_cache_layout", "cpu_key_order"]

KeyOrder = Literal["token_major", "transposed"]

_CPU_LAYOUTS = (CacheLayout.CPU, CacheLayout.CPU_KT)


def cpu_key_order(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> KeyOrder:
    """Write one block with vLLM's CPU cache op and read back the order of its keys and values.

    Raises NotImplementedError naming the ISA when the values are not token-major
    or the keys neither token-major nor transposed (e.g. AMX's packed tiles).
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


def cpu_cache_layout(layout: CacheLayout, cache: torch.Tensor, block_size: int, head_size: int,
                     kv_cache_dtype: str = "auto", configured: bool = False) -> CacheLayout:
    """The layout to read ``cache`` with: for a CPU-shaped cache on the CPU, ``CPU`` or ``CPU_KT``
    as vLLM's cache op writes it; any other ``layout`` unchanged.

    ``layout`` is the one detected from the shape (``CPU`` for both) or, with
    ``configured``, the one the user named: a configured ``CPU`` / ``CPU_KT`` that
    vLLM's op contradicts raises ValueError naming both (reading it would corrupt
    every partial block).
    """
    if layout not in _CPU_LAYOUTS or cache.device.type != "cpu":
        return layout
    order = cpu_key_order(cache.dtype, block_size, head_size, kv_cache_dtype)
    found = CacheLayout.CPU_KT if order == "transposed" else CacheLayout.CPU
    if configured and layout is not found:
        raise ValueError(
            f"kv_connector_extra_config['cache_layout']={layout.value!r}, but vLLM's CPU cache op stores keys "
            f"{order.replace('_', '-')} for {cache.dtype}, block_size {block_size}, head_size {head_size}: "
            f"use {found.value!r} (or leave cache_layout unset)"
        )
    return found
