"""The typed errors of ncclkv.

Bad input and configuration raise ``ValueError`` (or ``TypeError``); failures
of peers, the protocol and transfers raise subclasses of :class:`NcclKVError`,
each carrying the values that disagree in its message.
"""

from __future__ import annotations

from typing import Self

__all__ = [
    "CapacityError",
    "ClosedError",
    "DuplicatePeerIdError",
    "HandshakeError",
    "InsecureFileError",
    "NcclKVError",
    "PeerAuthError",
    "PeerClosedError",
    "PeerLostError",
    "PeerResetError",
    "ProtocolError",
    "ShapeMismatchError",
    "TransferError",
    "TransferTimeout",
]


class InsecureFileError(ValueError):
    """A key, secret or allowed-keys file or directory that others could read or change (docs/SECURITY.md, "Files
    and their modes"): refused at load. ``path`` and ``mode`` (its permission bits) are those of the object refused."""

    def __init__(self, message: str, path: str, mode: int) -> None:
        super().__init__(message)
        self.path = path
        self.mode = mode


class NcclKVError(RuntimeError):
    """Base of every runtime failure ncclkv reports."""


class ProtocolError(NcclKVError):
    """A control message that is malformed, unknown, oversized or of the wrong version."""


class HandshakeError(NcclKVError):
    """Two sides that cannot talk: mismatched geometry, dtype, layout or protocol version."""


class PeerLostError(NcclKVError):
    """A peer stopped answering heartbeats or its connection broke.

    ``loss_seq``: set by the channel that reported the loss, from its ``Channel.loss_seq`` counter; what was
    agreed with the peer before (a handshake started at a lower count) is stale, what came after is not.
    ``address``: where the channel reached the life it lost (None: it only reached us, or it was never
    connected to); a request that names the peer id at another address is for another life. ``incarnation``:
    the life lost, when another one of the peer id replaced it (it restarted; 0: not that, or not known)."""

    loss_seq: int | None = None
    address: str | None = None
    incarnation: int = 0

    def stamped(self, loss_seq: int | None = None, address: str | None = None, incarnation: int = 0) -> Self:
        """This error, its loss's ``loss_seq``, ``address`` and ``incarnation`` set (see the class)."""
        self.loss_seq, self.address, self.incarnation = loss_seq, address, incarnation
        return self


class PeerClosedError(PeerLostError):
    """A peer closed its channel (it said Bye): lost, but on purpose."""


class PeerAuthError(PeerLostError):
    """A peer this channel cannot authenticate with, for certain: its server refused our CURVE key, the server key
    we were given is not its key, one side has no CURVE, or its frames and ours fail the shared secret's MAC. Lost
    as soon as ZMQ or the peer shows it, not at ``deadline_s``; the message names the address and why. Not
    transient: asking again fails the same way until the keys or secrets are set alike (docs/SECURITY.md)."""


class DuplicatePeerIdError(PeerLostError):
    """Another live process uses this channel's peer id (two engines given one ``engine_id``): a peer refuses our
    frames because it took that process, a later life of the id, for our restart. Only a live process can read that
    refusal (a dead life's late frames are refused to no one), so it is certain. The message names the peer id,
    both lives and where each is. Not transient: asking again fails the same way while the other one runs."""


class PeerResetError(PeerLostError):
    """What a peer held about us is gone while the peer itself is there: it had declared us lost (we were
    stopped or unreachable for longer than its deadline), it restarted under the same peer id, or it moved to
    another address. Shake hands with it again; a request refused this way may be sent once more."""


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
