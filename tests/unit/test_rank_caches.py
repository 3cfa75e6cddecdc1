"""``RankCaches.slot_map``: block ids are checked against the fewest blocks of any registered layer's cache."""

from __future__ import annotations

import pytest
import torch

from ncclkv.engine._caches import RankCaches
from ncclkv.layout import KVGeometry, ParallelLayout
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
