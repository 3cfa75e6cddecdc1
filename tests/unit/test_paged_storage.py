"""Tensors whose storage no longer holds what their shape says: refused before a raw pointer reaches C.

The native kernel is handed data pointers and byte strides. A wire or cache
whose storage was shrunk under it (``untyped_storage().resize_``) passed every
shape, dtype and contiguity check, and the gather wrote or read past the end of
the allocation (a crash; AddressSanitizer: heap-buffer-overflow). The cache's
geometry is cached per layer shape, so even a cache checked at its first call
went unchecked after it. torch's own ops refuse such tensors at every view.
"""

from __future__ import annotations

import pytest
import torch

from ncclkv.layout import Span
from ncclkv.paged import CacheLayout, PagedCacheSpec, SlotMap, gather, scatter
from ncclkv.paged._native import copy_part

KERNELS = ["native", "torch"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_wire_whose_storage_shrank_is_refused(kernel: str) -> None:
    cache = torch.ones(8, 2, 16, 256, dtype=torch.bfloat16)
    spec = PagedCacheSpec.from_tensor(cache, CacheLayout.CPU)
    out = torch.empty(spec.wire_shape(64, 2), dtype=cache.dtype)
    out.untyped_storage().resize_(64)  # shape still 128 KiB
    with pytest.raises((ValueError, RuntimeError), match="storage|out of bounds"):
        gather(cache, spec, [0, 1, 2, 3], Span(0, 64), Span(0, 2), out, kernel=kernel)


@pytest.mark.parametrize("layout", [CacheLayout.CPU, CacheLayout.CPU_AMX])
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_a_cache_whose_storage_shrank_after_its_first_copy_is_refused(layout: CacheLayout, op: str) -> None:
    cache = torch.zeros(64, 8, 32, 256, dtype=torch.bfloat16)
    spec = PagedCacheSpec.from_tensor(cache, layout)
    wire = torch.zeros(spec.wire_shape(32, 8), dtype=cache.dtype)
    gather(cache, spec, [0], Span(0, 32), Span(0, 8), wire, kernel="native")  # checked and cached here
    cache.untyped_storage().resize_(4096)
    # CPU_AMX's views are made at every call, and torch refuses them; the others' geometry is cached.
    refused = (RuntimeError, r"out of bounds for storage of size 4096") if layout == CacheLayout.CPU_AMX else (
        ValueError, r"cache \[64, 8, 32, 256\] reaches \d+ bytes into its storage, which holds 4096")
    with pytest.raises(refused[0], match=refused[1]):
        if op == "gather":
            gather(cache, spec, [63], Span(0, 32), Span(0, 8), wire, kernel="native")
        else:
            scatter(wire, cache, spec, [63], Span(0, 32), Span(0, 8), kernel="native")


def test_copy_part_checks_every_storage_it_reads_or_writes() -> None:
    part = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    wire = torch.zeros(16, 2, 64, dtype=torch.float16)
    ids = torch.tensor([3], dtype=torch.int64)
    copy_part(True, part, wire, ids, 16, 0)  # as given: fine
    for shrunk, name in ((part, "part"), (wire, "wire"), (ids, "block_ids")):
        kept = shrunk.untyped_storage().nbytes()
        shrunk.untyped_storage().resize_(2)
        with pytest.raises(ValueError, match=rf"^{name} .* into its storage, which holds 2$"):
            copy_part(True, part, wire, ids, 16, 0)
        shrunk.untyped_storage().resize_(kept)


def test_the_kernels_block_table_is_not_public() -> None:
    """Written to after a first gather (the range was checked once, as the tuple), it sent C past the cache."""
    slots = SlotMap([0, 1], 16)
    assert not hasattr(slots, "ids_cpu")
