"""Paged KV caches: gather a request's slice of one layer into the wire format, scatter it back.

The wire format is ``[2, tokens, heads, head_size]`` (K then V; MLA ``[1, tokens,
latent]``), contiguous and independent of either side's block size and layout.
"""

from ._copy import CacheViews, cache_views, gather, scatter
from ._native import set_copy_threads
from ._slots import BlockRun, SlicePlan, SlotMap
from ._spec import CPU_LAYOUTS, CacheLayout, PagedCacheSpec, amx_views, detect_layout, kv_view, part_views, wire_shape

__all__ = [
    "CPU_LAYOUTS",
    "BlockRun",
    "CacheLayout",
    "CacheViews",
    "PagedCacheSpec",
    "SlicePlan",
    "SlotMap",
    "amx_views",
    "cache_views",
    "detect_layout",
    "gather",
    "kv_view",
    "part_views",
    "scatter",
    "set_copy_threads",
    "wire_shape",
]
