"""Shared by the paged tests: random caches of each layout and a reference read straight from each layout's definition."""

from __future__ import annotations

import itertools
import random

import torch

from ncclkv.layout import Span
from ncclkv.paged import CacheLayout

# "hnd" is the contiguous physical tensor, "hnd_view" vLLM's permuted view of it. The "packed" variants are
# vLLM 0.32's GPU view [nb, H, bs, 2*D] (K then V per token) in three of its KVCacheLayouts: LBHNC (contiguous),
# LBNHC (tokens before heads) and BLNHC (blocks outermost: each block holds two layers' pages; layer 1 is read).
VARIANTS = ["nhd", "hnd", "hnd_view", "flashinfer", "cpu", "cpu_kt", "cpu_amx", "packed", "packed_nhd", "packed_outer"]
PACKED_VARIANTS = ("packed", "packed_nhd", "packed_outer")
LAYOUTS = {
    "packed": CacheLayout.PACKED,
    "packed_nhd": CacheLayout.PACKED,
    "packed_outer": CacheLayout.PACKED,
    "mla4": CacheLayout.MLA,
    "nhd": CacheLayout.FLASH_NHD,
    "hnd": CacheLayout.FLASH_HND,
    "hnd_view": CacheLayout.FLASH_HND,
    "flashinfer": CacheLayout.FLASHINFER,
    "cpu": CacheLayout.CPU,
    "cpu_kt": CacheLayout.CPU_KT,
    "cpu_amx": CacheLayout.CPU_AMX,
    "mla": CacheLayout.MLA,
}
CPU_VARIANTS = ("cpu", "cpu_kt", "cpu_amx")
# MLA as a 3-d tensor, and as vLLM 0.32's 4-d [nb, 1, bs, latent] view.
MLA_VARIANTS = ("mla", "mla4")
# CPU_AMX packs 16-row tiles: its block size and head size are multiples of 16.
AMX_MIN = 16
DTYPES = [torch.float32, torch.bfloat16]
# Every element size the native kernel has a branch for (1, 2, 4, 8 bytes; 2 and 4 take SIMD transposes).
ALL_SIZES = [torch.uint8, torch.bfloat16, torch.float32, torch.float64]
# CPU caches take the native kernel by default; the torch-op path is what CUDA caches run, so both are tested.
KERNELS = ["native", "torch"]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, rng: random.Random) -> torch.Tensor:
    """Random bit patterns (NaN payloads and -0.0 included), so only a byte-exact copy compares equal."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    int_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[dtype.itemsize]
    info = torch.iinfo(int_dtype)
    return torch.randint(info.min, info.max, shape, dtype=int_dtype, generator=gen).view(dtype)


def make_cache(variant: str, nb: int, bs: int, heads: int, dim: int, dtype: torch.dtype, rng: random.Random):
    """(tensor handed to ncclkv, the raw contiguous tensor the reference reads)."""
    shape = {
        "nhd": (2, nb, bs, heads, dim),
        "hnd": (2, nb, heads, bs, dim),
        "hnd_view": (2, nb, heads, bs, dim),
        "flashinfer": (nb, 2, bs, heads, dim),
        "cpu": (nb, heads, bs, 2 * dim),
        "cpu_kt": (nb, heads, bs, 2 * dim),
        "cpu_amx": (nb, heads, bs, 2 * dim),
        "packed": (nb, heads, bs, 2 * dim),
        "packed_nhd": (nb, bs, heads, 2 * dim),
        "packed_outer": (nb, 2, bs, heads, 2 * dim),
        "mla": (nb, bs, dim),
        "mla4": (nb, 1, bs, dim),
    }[variant]
    raw = random_bits(shape, dtype, rng)
    views = {
        "hnd_view": lambda: raw.permute(0, 1, 3, 2, 4),
        "packed_nhd": lambda: raw.permute(0, 2, 1, 3),
        "packed_outer": lambda: raw[:, 1].permute(0, 2, 1, 3),
    }
    return (views[variant]() if variant in views else raw), raw


def ref_cell(raw: torch.Tensor, variant: str, part: int, block: int, offset: int, head: int) -> torch.Tensor:
    """A view of the ``head_size`` values of one (part, block, offset, head), read straight from the layout's
    definition: ``[head_size]``, or for cpu_amx ``[D/2, 2]`` (K) / ``[D/16, 16]`` (V), the dims in order."""
    if variant == "nhd":
        return raw[part, block, offset, head]
    if variant in ("hnd", "hnd_view"):
        return raw[part, block, head, offset]
    if variant == "flashinfer":
        return raw[block, part, offset, head]
    if variant == "mla":
        return raw[block, offset]
    if variant == "mla4":
        return raw[block, 0, offset]
    if variant in PACKED_VARIANTS:  # per token and head: K [D] then V [D]
        dim = raw.shape[-1] // 2
        row = {"packed": lambda: raw[block, head, offset], "packed_nhd": lambda: raw[block, offset, head],
               "packed_outer": lambda: raw[block, 1, offset, head]}[variant]()
        return row[part * dim : (part + 1) * dim]
    _, num_heads, bs, two_dim = raw.shape
    dim = two_dim // 2
    half = ((block * num_heads + head) * 2 + part) * bs * dim  # K [bs, D] (cpu_kt: [D, bs]) then V [bs, D]
    if variant == "cpu_kt" and part == 0:
        return raw.reshape(-1)[half + offset : half + dim * bs : bs]
    if variant == "cpu_amx":  # K [bs/16, D/2, 16, 2], V [D/16, bs/2, 16, 2] per (block, head)
        base = raw.storage_offset() + half
        if part == 0:
            tile, row = divmod(offset, 16)
            return raw.as_strided((dim // 2, 2), (32, 1), base + (tile * (dim // 2) * 16 + row) * 2)
        pair, second = divmod(offset, 2)
        return raw.as_strided((dim // 16, 16), (bs * 16, 2), base + pair * 32 + second)
    return raw.reshape(-1)[half + offset * dim : half + (offset + 1) * dim]


def ref_gather(raw, variant, bs, block_ids, tokens: Span, heads: Span) -> torch.Tensor:
    parts = 1 if variant in MLA_VARIANTS else 2
    dim = raw.shape[-1] // 2 if variant in CPU_VARIANTS + PACKED_VARIANTS else raw.shape[-1]
    wire = torch.empty(parts, len(tokens), len(heads), dim, dtype=raw.dtype)
    for part, t, h in itertools.product(range(parts), tokens, heads):
        wire[part, t - tokens.start, h - heads.start] = ref_cell(raw, variant, part, block_ids[t // bs], t % bs, h).reshape(-1)
    return wire.view(1, len(tokens) * len(heads), dim) if variant in MLA_VARIANTS else wire


def ref_scatter(wire, raw, variant, bs, block_ids, tokens: Span, heads: Span) -> None:
    parts = 1 if variant in MLA_VARIANTS else 2
    wire = wire.view(parts, len(tokens), len(heads), wire.shape[-1])
    for part, t, h in itertools.product(range(parts), tokens, heads):
        cell = ref_cell(raw, variant, part, block_ids[t // bs], t % bs, h)
        cell.copy_(wire[part, t - tokens.start, h - heads.start].view(cell.shape))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # new_empty: truly unit-stride copies (a size-1 strided slice counts as contiguous and keeps its stride).
    return a.shape == b.shape and torch.equal(
        a.new_empty(a.shape).copy_(a).view(torch.uint8), b.new_empty(b.shape).copy_(b).view(torch.uint8)
    )
