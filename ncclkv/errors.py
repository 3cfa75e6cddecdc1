"""The typed errors of ncclkv.

Bad input and configuration raise ``ValueError`` (or ``TypeError``); failures
of peers, the protocol and transfers raise subclasses of :class:`NcclKVError`,
each carrying the values that disagree in its message.
"""

from __future__ import annotations

__all__ = [
    "CapacityError",
    "ClosedError",
    "HandshakeError",
    "NcclKVError",
    "PeerClosedError",
    "PeerLostError",
    "ProtocolError",
    "ShapeMismatchError",
    "TransferError",
    "TransferTimeout",
]


class NcclKVError(RuntimeError):
    """Base of every runtime failure ncclkv reports."""


class ProtocolError(NcclKVError):
    """A control message that is malformed, unknown, oversized or of the wrong version."""


class HandshakeError(NcclKVError):
    """Two sides that cannot talk: mismatched geometry, dtype, layout or protocol version."""


class PeerLostError(NcclKVError):
    """A peer stopped answering heartbeats or its connection broke."""


class PeerClosedError(PeerLostError):
    """A peer closed its channel (it said Bye): lost, but on purpose."""


class TransferError(NcclKVError):
    """A transfer of one request failed; other requests are unaffected."""


class TransferTimeout(TransferError, TimeoutError):
    """A wait passed its deadline."""


class ShapeMismatchError(NcclKVError):
    """A tensor that does not match what was announced or planned."""


class CapacityError(NcclKVError):
    """A buffer refused an entry: larger than its capacity, or full with eviction off."""


class ClosedError(NcclKVError):
    """A call on a buffer, channel, link or engine that was closed."""
