"""Per-peer data links: ordered asynchronous point-to-point between two ranks.

A :class:`DataPlane` per engine rank hosts a TCPStore and opens links on the
fly: each link is a 2-rank torch.distributed group (gloo for CPU tensors,
NCCL for CUDA tensors, one code path) with one ordered pipe per direction.
:func:`loopback_pair` and :class:`LoopbackTransport` give the same
:class:`Link` over an in-process wire, to test the layers above.
"""

from ._base import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_BYTES, LinkBase, LinkFactory, LinkStats
from ._data_plane import DataPlane
from ._link import Link
from ._loopback import LoopbackHub, LoopbackTransport, loopback_pair

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_IN_FLIGHT_BYTES",
    "DataPlane",
    "Link",
    "LinkBase",
    "LinkFactory",
    "LinkStats",
    "LoopbackHub",
    "LoopbackTransport",
    "loopback_pair",
]
