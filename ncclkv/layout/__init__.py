"""Pure layout math: parallel layouts, KV geometry, rois, shards and transfer plans.

Nothing here imports torch.distributed, ZMQ or vLLM, so every law can be
unit-tested and property-tested in one process.
"""

from ._geometry import DTYPE_SIZES, KVGeometry, ParallelLayout, pp_layer_spans
from ._plan import PlanError, Route, TransferPlan, plan
from ._roi import Roi
from ._shard import shard_roi
from ._span import Span, SpanSet

__all__ = [
    "DTYPE_SIZES",
    "KVGeometry",
    "ParallelLayout",
    "PlanError",
    "Roi",
    "Route",
    "Span",
    "SpanSet",
    "TransferPlan",
    "plan",
    "pp_layer_spans",
    "shard_roi",
]
