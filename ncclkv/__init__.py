"""ncclkv: move LLM KV caches between tensor/pipeline-parallel prefill and decode ranks.

``import ncclkv`` needs only the runtime dependencies (torch, pyzmq, msgspec,
numpy); the vLLM connector lives in :mod:`ncclkv.connector` and imports vLLM
only there.
"""

from .layout import KVGeometry, ParallelLayout, Roi, Span, SpanSet

__version__ = "0.1.0"

__all__ = ["KVGeometry", "ParallelLayout", "Roi", "Span", "SpanSet", "__version__"]
