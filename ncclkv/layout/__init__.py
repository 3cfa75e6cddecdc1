"""Pure layout math: parallel layouts, KV geometry, rois, shards and transfer plans.

Nothing here imports torch.distributed, ZMQ or vLLM, so every law can be
unit-tested and property-tested in one process.
"""

from ._geometry import DTYPE_SIZES, KVGeometry, ParallelLayout, pp_layer_spans
from ._roi import Roi
from ._span import Span, SpanSet

__all__ = [
    "DTYPE_SIZES",
    "KVGeometry",
    "ParallelLayout",
    "Roi",
    "Span",
    "SpanSet",
    "pp_layer_spans",
]
