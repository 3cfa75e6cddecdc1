"""Pure layout math: parallel layouts, KV geometry, rois, shards and transfer plans.

Nothing here imports torch.distributed, ZMQ or vLLM, so every law can be
unit-tested and property-tested in one process.
"""

from ._geometry import DTYPE_SIZES, MAX_WORLD_SIZE, KVGeometry, ParallelLayout, pp_layer_spans
from ._plan import PlanError, Route, TransferPlan, cached_plan, plan, routes_between, routes_from_rank
from ._roi import Roi
from ._shard import shard_roi
from ._span import Span, SpanSet

__all__ = [
    "DTYPE_SIZES",
    "MAX_WORLD_SIZE",
    "KVGeometry",
    "ParallelLayout",
    "PlanError",
    "Roi",
    "Route",
    "Span",
    "SpanSet",
    "TransferPlan",
    "cached_plan",
    "plan",
    "pp_layer_spans",
    "routes_between",
    "routes_from_rank",
    "shard_roi",
]
