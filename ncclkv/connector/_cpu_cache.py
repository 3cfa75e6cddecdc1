"""Which CPU layout vLLM's attention kernels really write: ``CPU``, ``CPU_KT`` or ``CPU_AMX``.

The CPU cache tensor is ``[num_blocks, heads, block_size, 2*head_size]`` and,
per (block, head), holds the keys in the first half and the values in the
second. Their order inside each half depends on the ISA vLLM picks
(``_get_attn_isa``): token-major (``CPU``), keys transposed to ``[head_size,
block_size]`` (``CPU_KT``: vLLM 0.32's portable ``vec`` / ``vec16`` kernels, every
dtype), or both packed in 16-row AMX tiles (``CPU_AMX``: the ``amx`` kernels,
bfloat16 with block_size a multiple of 32). The shape cannot tell them apart, so
:func:`vllm_cpu_layout` writes one block with vLLM's own cache-write op and
keeps the layout that reads it back. As vLLM's attention does, it hands the op
keys and values in the model's dtype, with the ISA picked for that dtype: with
``kv_cache_dtype`` fp8 the cache is uint8 (fp8 codes) and the model's dtype is
another.
"""

from __future__ import annotations

import torch

from ..layout import Span
from ..paged import CPU_LAYOUTS, CacheLayout, PagedCacheSpec, gather

__all__ = ["cpu_cache_layout", "vllm_cpu_layout"]

def vllm_cpu_layout(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto",
                    model_dtype: torch.dtype | None = None) -> CacheLayout:
    """Write one block of random keys and values with vLLM's CPU cache op; the layout whose gather reads them back.

    ``dtype``: the cache's; ``model_dtype``: that of the keys and values vLLM's attention hands the op (the
    model's, which picks the ISA; None: ``dtype``). Random bits (not small integers) so that no other order
    can read back the same values by chance; for an fp8 cache (``dtype`` uint8), random fp8 codes, each exact
    in the model's dtype, so that the op stores them unchanged. Raises NotImplementedError naming the ISA when
    no CPU layout reads what the op wrote.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model_dtype = model_dtype or dtype
    isa = _get_attn_isa(model_dtype, block_size, head_size, kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        want = torch.randn(2, block_size, 1, head_size, generator=gen).to(dtype)
        kv = want.to(model_dtype)
    else:  # fp8 codes, e5m2 or (any other fp8 name) e4m3: no nan, inf or -0 (the op stores +0 for it)
        fp8 = torch.float8_e5m2 if kv_cache_dtype.endswith("e5m2") else torch.float8_e4m3fn
        codes = torch.randint(0, 256, (2, block_size, 1, head_size), generator=gen, dtype=torch.uint8)
        codes[~torch.isfinite(codes.view(fp8).float()) | (codes == 0x80)] = 0
        want, kv = codes.to(dtype), codes.view(fp8).to(model_dtype)
    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    keys, values = cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(kv[0], kv[1], keys, values, torch.arange(block_size), isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    for layout in CPU_LAYOUTS:
        try:
            spec = PagedCacheSpec.from_tensor(cache, layout)
        except ValueError:  # e.g. CPU_AMX with a block size that is no multiple of 16
            continue
        out = torch.empty_like(want)
        if torch.equal(gather(cache, spec, [0], Span(0, block_size), Span(0, 1), out), want):
            return layout
    raise NotImplementedError(f"vLLM CPU attention (ISA {isa!r}) stores keys and values in an order no ncclkv "
                              f"CPU layout reads ({dtype}, block_size {block_size}, head_size {head_size})")


def cpu_cache_layout(layout: CacheLayout, cache: torch.Tensor, block_size: int, head_size: int,
                     kv_cache_dtype: str = "auto", configured: bool = False,
                     model_dtype: torch.dtype | None = None) -> CacheLayout:
    """The layout to read ``cache`` with: for a CPU-shaped cache on the CPU, ``CPU``, ``CPU_KT`` or
    ``CPU_AMX`` as vLLM's cache op writes it; any other ``layout`` unchanged.

    ``layout`` is the one detected from the shape (``CPU`` for all three) or, with
    ``configured``, the one the user named: a configured CPU layout that
    vLLM's op contradicts raises ValueError naming both (reading it would corrupt
    every partial block). ``model_dtype``: the model's (see :func:`vllm_cpu_layout`; None: the cache's).
    """
    if layout not in CPU_LAYOUTS or cache.device.type != "cpu":
        return layout
    found = vllm_cpu_layout(cache.dtype, block_size, head_size, kv_cache_dtype, model_dtype)
    if configured and layout is not found:
        raise ValueError(
            f"kv_connector_extra_config['cache_layout']={layout.value!r}, but vLLM's CPU cache op writes "
            f"{found.value!r} for {cache.dtype}, block_size {block_size}, head_size {head_size}: "
            f"use {found.value!r} (or leave cache_layout unset)"
        )
    return found
