"""``RankCaches``: what register() takes, and block ids checked against the fewest blocks of any layer's cache."""

from __future__ import annotations

import pytest
import torch

from ncclkv.engine._caches import RankCaches
from ncclkv.errors import ShapeMismatchError
from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.paged import CacheLayout

ONE = ParallelLayout(1, 1)
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")
BLOCK = 4


def _cache(num_blocks: int) -> torch.Tensor:
    """A CPU-layout cache: [blocks, heads, block size, 2 * head size]."""
    return torch.zeros(num_blocks, GEOMETRY.num_kv_heads, BLOCK, 2 * GEOMETRY.head_size)


def test_slot_map_takes_the_fewest_blocks_of_any_layer_and_follows_a_new_registration() -> None:
    caches = RankCaches(ONE, GEOMETRY, 0, 0)
    with pytest.raises(ValueError, match="no KV caches registered on this rank"):
        caches.slot_map([0])
    caches.register({0: _cache(8), 1: _cache(5)}, CacheLayout.CPU)
    assert caches.slot_map([0, 4]).block_ids == (0, 4)
    with pytest.raises(ValueError, match=r"^block ids \[5, 7\] are outside the 5 blocks of this rank's caches$"):
        caches.slot_map([4, 5, 7])
    caches.register({0: _cache(8), 1: _cache(8)}, CacheLayout.CPU)
    assert caches.slot_map([7]).block_ids == (7,)


def test_register_refuses_caches_a_gather_or_scatter_would_refuse_later_naming_the_layer() -> None:
    """What the copies cannot move is refused by register(), typed: before, such caches were taken and the first
    gather failed on the link's thread after the peer was told of the tensor, which broke the link (and with it
    every request on it), and a cache of another block size in one layer wrote layer 0 and failed layer 1."""
    caches = RankCaches(ONE, GEOMETRY, 0, 0)
    heads, dim = GEOMETRY.num_kv_heads, GEOMETRY.head_size
    cases = [
        ({0: _cache(8), 1: torch.zeros(8, heads, 2 * BLOCK, 2 * dim)}, CacheLayout.CPU,
         r"every layer's cache must have one block size .*got \{0: 4, 1: 8\}"),
        # rows of [block_size, 2*head_size] that are not contiguous: the native kernel's strides
        ({layer: torch.zeros(8, heads, BLOCK, 4 * dim)[..., : 2 * dim] for layer in range(2)}, CacheLayout.CPU,
         r"layer 0: this CPU cache cannot be moved: a CPU cache needs contiguous \[block_size, 2\*head_size\] rows"),
        ({"0": _cache(8), 1: _cache(8)}, CacheLayout.CPU, r"registered layers must be global layer indices \(ints\), got \['0'\]"),
    ]
    for kv_caches, layout, message in cases:
        with pytest.raises((ShapeMismatchError, ValueError), match=message):
            caches.register(kv_caches, layout)  # type: ignore[arg-type]
        assert not caches.registered  # nothing kept of a refused registration
    one_head = RankCaches(ONE, KVGeometry(num_layers=2, num_kv_heads=1, head_size=16, dtype="float32"), 0, 0)
    with pytest.raises(ShapeMismatchError, match=r"layer 0: a MLA cache for a geometry with use_mla=False"):
        one_head.register({layer: torch.zeros(8, BLOCK, 16) for layer in range(2)}, CacheLayout.MLA)
    mla = RankCaches(ONE, KVGeometry(num_layers=2, num_kv_heads=1, head_size=16, dtype="float32", use_mla=True), 0, 0)
    with pytest.raises(ShapeMismatchError, match=r"layer 0: a CPU cache for a geometry with use_mla=True"):
        mla.register({layer: torch.zeros(8, 1, BLOCK, 32) for layer in range(2)}, CacheLayout.CPU)
    mla.register({layer: torch.zeros(8, BLOCK, 16) for layer in range(2)}, CacheLayout.MLA)
    caches.register({0: _cache(8), 1: _cache(8)}, CacheLayout.CPU)
    assert caches.registered


def test_slot_map_refuses_a_block_twice_among_the_tokens_moved() -> None:
    caches = RankCaches(ONE, GEOMETRY, 0, 0)
    caches.register({0: _cache(8), 1: _cache(8)}, CacheLayout.CPU)
    with pytest.raises(ValueError, match=r"block ids \[2\] appear more than once among the blocks of tokens \[0,9\)"):
        caches.slot_map([2, 3, 2], Span(0, 9))
    assert caches.slot_map([2, 3, 2], Span(0, 8)).block_ids == (2, 3, 2)  # the third block holds none of them
    assert caches.slot_map([2, 2]).block_ids == (2, 2)  # no tokens named: the ids alone are checked
