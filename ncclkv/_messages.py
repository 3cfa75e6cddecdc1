"""The control message types of :mod:`ncclkv.protocol` (msgspec Structs, tagged union).

See :mod:`ncclkv.protocol` for the wire format and what decoding enforces.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal, Protocol, TypeAlias

from msgspec import Meta, Struct

from . import errors
from .layout import KVGeometry, ParallelLayout, Span

__all__ = [
    "INCARNATION_RANDOM_BITS",
    "MAX_EXTRA_KEYS",
    "MAX_HOLD",
    "MAX_ID_CHARS",
    "MAX_MODEL_DIM",
    "MAX_PUSH_TOKENS",
    "MAX_ROUTES",
    "MAX_SHAPE_DIMS",
    "MAX_TEXT_CHARS",
    "PROTOCOL_VERSION",
    "Ack",
    "Announce",
    "Bye",
    "Done",
    "Envelope",
    "ErrorCode",
    "ErrorMsg",
    "GeometryMsg",
    "Handshake",
    "HandshakeAck",
    "Heartbeat",
    "LayoutMsg",
    "Message",
    "PullRequest",
    "PushBlocks",
    "PushOffer",
    "Ready",
    "Reset",
    "RouteMsg",
]

# 2: PushOffer.blocks; gloo links carry frame headers (ncclkv.transport._framing); 3: Announce.piece; 4: Bye;
# 5: Heartbeat.incarnation, Handshake.incarnation, Reset, ErrorCode.PEER_RESET; 6: Reset.incarnation;
# 7: incarnations grow with their channel's start time (INCARNATION_RANDOM_BITS), so lives can be ordered;
# 8: Announce.num_layers (a pull sends a route's consecutive small layers in one tensor); 9: PullRequest.hold (the
# hold of a request id a pull or decline is for: a late one is no longer taken for the id's next hold); 10: the hold in
# Announce, Done and ErrorMsg; 11: ErrorCode.REPLACED_LIFE and ErrorMsg.incarnation (the refusal of a life of the
# receiver's peer id that a later one replaced, naming that life: decided by code and incarnation, never by its text)
PROTOCOL_VERSION = 11
# The low bits of an incarnation that are random; above them, the channel's start time in ms since the epoch.
INCARNATION_RANDOM_BITS = 20
MAX_SHAPE_DIMS = 8
MAX_ID_CHARS = 512
MAX_TEXT_CHARS = 4096
# Counts a peer sends that size our work: far above any real deployment, low enough
# that nothing built from them (lists, loops, plans) can exhaust memory or time.
MAX_ROUTES = 4096  # routes in one PullRequest / PushOffer
MAX_MODEL_DIM = 1 << 16  # tp_size, pp_size, num_layers, num_kv_heads, head_size, partition entries
MAX_PUSH_TOKENS = 1 << 16  # token ids in one PushBlocks (at most 9 B each in msgpack: under 600 KiB)
MAX_EXTRA_KEYS = 8  # extra hash keys in one PushBlocks

NonNeg = Annotated[int, Meta(ge=0)]
ModelDim = Annotated[int, Meta(ge=1, le=MAX_MODEL_DIM)]
Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
DType = Annotated[str, Meta(min_length=1, max_length=64)]
Pair = tuple[NonNeg, NonNeg]
# A channel's incarnation: new per Channel object (a process, or a channel, restarted under the same peer id has
# another): its start time in ms, then INCARNATION_RANDOM_BITS random bits, so a later life of a peer id has a larger
# one (hosts' clocks apart by less than the time between two lives); never 0 from a channel; 0: not given (a
# hand-made message), never compared.
Incarnation = Annotated[int, Meta(ge=0, le=2**63 - 1)]
# The one life a Reset is for: always named (a Reset for whichever life answers is what went wrong before).
LostIncarnation = Annotated[int, Meta(ge=1, le=2**63 - 1)]
# Which hold of a request id (the producer's finish(..., hold=h)) a pull or decline is for: chosen by the caller per
# hold, given alike to the consumer; 0: not named, a pull is then taken for whichever hold of the id is there.
MAX_HOLD = 2**63 - 1
HoldNumber = Annotated[int, Meta(ge=0, le=MAX_HOLD)]
Role = Literal["producer", "consumer", "both"]


class _Body(Struct, frozen=True, forbid_unknown_fields=True):
    """Base of the value types on the wire: immutable, no unknown fields."""


class _Tagged(_Body, frozen=True, forbid_unknown_fields=True, tag=True):
    """Base of the top-level messages; each subclass sets its short tag."""


class LayoutMsg(_Body, frozen=True, forbid_unknown_fields=True):
    tp_size: ModelDim
    pp_size: ModelDim
    layer_partition: Annotated[tuple[ModelDim, ...], Meta(max_length=MAX_MODEL_DIM)] | None

    @classmethod
    def from_layout(cls, layout: ParallelLayout) -> LayoutMsg:
        return cls(layout.tp_size, layout.pp_size, layout.layer_partition)

    def to_layout(self) -> ParallelLayout:
        """The layout; ``ValueError`` if the values do not form one (e.g. partition length != pp_size)."""
        return ParallelLayout(self.tp_size, self.pp_size, self.layer_partition)


class GeometryMsg(_Body, frozen=True, forbid_unknown_fields=True):
    num_layers: ModelDim
    num_kv_heads: ModelDim
    head_size: ModelDim
    dtype: DType
    use_mla: bool

    @classmethod
    def from_geometry(cls, geometry: KVGeometry) -> GeometryMsg:
        return cls(geometry.num_layers, geometry.num_kv_heads, geometry.head_size, geometry.dtype, geometry.use_mla)

    def to_geometry(self) -> KVGeometry:
        """The geometry; ``ValueError`` for an unknown dtype or MLA with more than one head."""
        return KVGeometry(self.num_layers, self.num_kv_heads, self.head_size, self.dtype, self.use_mla)


class _RouteLike(Protocol):
    src: int
    dst: int
    layers: Span
    heads: Span
    tokens: Span


class RouteMsg(_Body, frozen=True, forbid_unknown_fields=True):
    """One route of a transfer plan; spans are ``(start, stop)`` pairs, half-open."""

    src: NonNeg
    dst: NonNeg
    layers: Pair
    heads: Pair
    tokens: Pair

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "tokens"):
            start, stop = getattr(self, name)
            if start > stop:
                raise ValueError(f"RouteMsg.{name} needs start <= stop, got ({start}, {stop})")

    @classmethod
    def from_spans(cls, src: int, dst: int, layers: Span, heads: Span, tokens: Span) -> RouteMsg:
        return cls(src, dst, (layers.start, layers.stop), (heads.start, heads.stop), (tokens.start, tokens.stop))

    @classmethod
    def from_route(cls, route: _RouteLike) -> RouteMsg:
        """From :class:`ncclkv.layout.Route` (or anything with its five attributes)."""
        return cls.from_spans(route.src, route.dst, route.layers, route.heads, route.tokens)

    def spans(self) -> tuple[Span, Span, Span]:
        """``(layers, heads, tokens)`` as Spans."""
        return Span(*self.layers), Span(*self.heads), Span(*self.tokens)


Routes = Annotated[tuple[RouteMsg, ...], Meta(max_length=MAX_ROUTES)]


class Handshake(_Tagged, frozen=True, forbid_unknown_fields=True, tag="hs"):
    """First message from each engine rank to a peer. ``data_addr`` is the ``host:port``
    of the TCPStore used for data-plane rendezvous; ``control_addr`` the sender's ZMQ address."""

    engine_id: Id
    role: Role
    rank: NonNeg
    layout: LayoutMsg
    geometry: GeometryMsg
    wire_dtype: DType
    protocol_version: NonNeg
    control_addr: Id
    data_addr: Id
    # A fresh nonce per handshake attempt, echoed by the responder: it names
    # the data link the two sides then open (a link id is never reused).
    session: Annotated[str, Meta(max_length=64)]
    # Whether the two ranks open a data link now (some rank pairs only exchange control).
    open_link: bool
    # The sender's channel incarnation (see Heartbeat): which life of the peer id this handshake is with.
    incarnation: Incarnation

    @classmethod
    def create(
        cls,
        engine_id: str,
        role: Role,
        rank: int,
        layout: ParallelLayout,
        geometry: KVGeometry,
        control_addr: str,
        data_addr: str,
        wire_dtype: str | None = None,
        session: str = "",
        open_link: bool = False,
        incarnation: int = 0,
    ) -> Handshake:
        """Build from layout values, at this build's :data:`PROTOCOL_VERSION`; wire dtype defaults to the cache dtype."""
        return cls(
            engine_id,
            role,
            rank,
            LayoutMsg.from_layout(layout),
            GeometryMsg.from_geometry(geometry),
            wire_dtype or geometry.dtype,
            PROTOCOL_VERSION,
            control_addr,
            data_addr,
            session,
            open_link,
            incarnation,
        )


class HandshakeAck(_Tagged, frozen=True, forbid_unknown_fields=True, tag="hs_ack"):
    """Not sent by ncclkv (the engine answers a :class:`Handshake` with its own, and this as unexpected); a
    handshake reply for channel-level users and tests."""

    engine_id: Id
    rank: NonNeg
    accepted: bool
    reason: Text


class PullRequest(_Tagged, frozen=True, forbid_unknown_fields=True, tag="pull"):
    """A consumer rank asks a producer rank to send it ``routes`` of one request (none: a decline, or a rank the
    plan gives nothing from this one). ``hold``: the hold of the request id it is for (the number the producer's
    ``finish`` was given); a pull for another hold than the one there is refused, a decline for one is not
    counted. 0: not named (either side), taken for the hold there."""

    request_id: Id
    dst_rank: NonNeg
    consumer_engine_id: Id
    routes: Routes
    num_tokens: NonNeg
    hold: HoldNumber = 0


ExtraKeyMsg = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)] | Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None


class PushBlocks(_Body, frozen=True, forbid_unknown_fields=True):
    """The full blocks of a pushed prompt, as :mod:`ncclkv.hashing` hashes them: their ``token_ids``
    (a multiple of ``block_size``, the producer's block size) and the ``extra_keys`` hashed with
    every block. The consumer names staged KV by these in its staging events."""

    token_ids: Annotated[tuple[NonNeg, ...], Meta(max_length=MAX_PUSH_TOKENS)]
    block_size: ModelDim
    extra_keys: Annotated[tuple[ExtraKeyMsg, ...], Meta(max_length=MAX_EXTRA_KEYS)]


class PushOffer(_Tagged, frozen=True, forbid_unknown_fields=True, tag="push"):
    """A producer rank offers to stream ``routes`` of one request as it computes them.

    The consumer rank reserves ``nbytes`` of staging (for tensors that land
    before its blocks exist) or refuses with ``capacity`` before any tensor
    is on the wire. ``blocks`` names the prompt's full blocks for the
    consumer's staging events; None when the producer does not know them or
    they would not fit a frame (the push works the same, unreported).
    """

    request_id: Id
    src_rank: NonNeg
    producer_engine_id: Id
    routes: Routes
    num_tokens: NonNeg
    nbytes: NonNeg
    blocks: PushBlocks | None


class Announce(_Tagged, frozen=True, forbid_unknown_fields=True, tag="ann"):
    """The tensor with per-link sequence number ``seq`` follows on the data plane."""

    request_id: Id
    layer: NonNeg
    route: RouteMsg
    shape: Annotated[tuple[NonNeg, ...], Meta(max_length=MAX_SHAPE_DIMS)]
    dtype: DType
    nbytes: NonNeg
    seq: NonNeg
    link: Id  # the data link the tensor rides on (two may be open when both sides started a handshake)
    # The route's tokens this tensor holds when the producer sends the (layer, route) slice in
    # pieces, one announced tensor each; None: all of them. ``shape`` is the piece's.
    piece: Pair | None = None
    # The tensor holds the slices of layers ``layer`` .. ``layer + num_layers - 1`` of the route, one after the
    # other: ``shape`` is then ``(num_layers, *slice shape)`` (a pull batches small layers, see the producer; the
    # consumer checks the shape against its plan, as any announced shape).
    num_layers: Annotated[int, Meta(ge=1, le=MAX_MODEL_DIM)] = 1
    hold: HoldNumber = 0  # the pull's hold number (PullRequest.hold) the tensor serves; 0: a push, or not named

    def __post_init__(self) -> None:
        if self.piece is not None and self.piece[0] > self.piece[1]:
            raise ValueError(f"Announce.piece needs start <= stop, got {self.piece}")  # the engine refuses empty ones


class Ack(_Tagged, frozen=True, forbid_unknown_fields=True, tag="ack"):
    request_id: Id
    seq: NonNeg | None


class Ready(_Tagged, frozen=True, forbid_unknown_fields=True, tag="ready"):
    """Not sent by ncclkv (the engine answers it as unexpected); the plain request channel-level users and the
    channel's tests send."""

    request_id: Id


class Done(_Tagged, frozen=True, forbid_unknown_fields=True, tag="done"):
    """A producer rank sent all ``num_tensors`` (layer, route) slices (``nbytes`` in all, in however many
    pieces) for one consumer rank."""

    request_id: Id
    num_tensors: NonNeg
    nbytes: NonNeg
    hold: HoldNumber = 0  # the pull's hold number (PullRequest.hold); 0: a push, or not named


class ErrorCode(str, enum.Enum):
    """Why a request failed; a str enum (not StrEnum) to keep Python 3.10 working."""

    UNKNOWN_REQUEST = "unknown_request"
    TIMEOUT = "timeout"
    PEER_LOST = "peer_lost"
    BAD_ANNOUNCE = "bad_announce"
    CAPACITY = "capacity"
    HANDSHAKE = "handshake"
    PROTOCOL = "protocol"
    CLOSED = "closed"
    UNSUPPORTED = "unsupported"
    INTERNAL = "internal"
    # The receiver holds no handshake with the sender (it declared it lost, or it restarted): shake hands again.
    PEER_RESET = "peer_reset"
    # The frame's life of this peer id was replaced by another (a later incarnation heard since): refused. Sent with
    # ``ErrorMsg.incarnation`` naming the refused life; the life it names, reading it, knows that another live
    # process uses its peer id (a dead life reads nothing).
    REPLACED_LIFE = "replaced_life"


# Exception class <-> code, most specific first (TransferTimeout is a TransferError).
_CODE_OF: tuple[tuple[type[BaseException], ErrorCode], ...] = (
    (errors.TransferTimeout, ErrorCode.TIMEOUT),
    (errors.PeerResetError, ErrorCode.PEER_RESET),
    (errors.PeerLostError, ErrorCode.PEER_LOST),
    (errors.ShapeMismatchError, ErrorCode.BAD_ANNOUNCE),
    (errors.CapacityError, ErrorCode.CAPACITY),
    (errors.HandshakeError, ErrorCode.HANDSHAKE),
    (errors.ProtocolError, ErrorCode.PROTOCOL),
    (errors.ClosedError, ErrorCode.CLOSED),
)
_ERROR_OF: dict[ErrorCode, type[errors.NcclKVError]] = {code: cls for cls, code in _CODE_OF}  # type: ignore[misc]
# Only received: a DuplicatePeerIdError raised here is a loss of a peer (sent as peer_lost), not a refusal of the
# receiver's life of its peer id.
_ERROR_OF[ErrorCode.REPLACED_LIFE] = errors.DuplicatePeerIdError


class ErrorMsg(_Tagged, frozen=True, forbid_unknown_fields=True, tag="err"):
    request_id: Id | None
    code: ErrorCode
    text: Text
    hold: HoldNumber = 0  # for a pull: its hold number (PullRequest.hold); 0: a push, or not named
    # For ``replaced_life``: the incarnation refused, the receiver's own if it is that life; 0: not named (other codes)
    incarnation: Incarnation = 0

    @classmethod
    def from_exception(cls, exc: BaseException, request_id: str | None = None, hold: int = 0) -> ErrorMsg:
        """The error reply for ``exc``: typed ncclkv errors keep their kind, anything else is ``internal``."""
        code = next((c for kind, c in _CODE_OF if isinstance(exc, kind)), ErrorCode.INTERNAL)
        text = f"{type(exc).__name__}: {exc}"
        if len(text) > MAX_TEXT_CHARS:
            text = text[: MAX_TEXT_CHARS - 3] + "..."
        return cls(request_id, code, text, hold)

    def to_exception(self, peer_id: str) -> errors.NcclKVError:
        """The local exception for this reply from ``peer_id`` (``TransferError`` for codes without a class)."""
        kind = _ERROR_OF.get(self.code, errors.TransferError)
        where = f" for request {self.request_id!r}" if self.request_id is not None else ""
        return kind(f"peer {peer_id!r} replied error {self.code.value!r}{where}: {self.text}")


class Heartbeat(_Tagged, frozen=True, forbid_unknown_fields=True, tag="hb"):
    """``sent_ns`` is the sender's monotonic clock: echoed back for RTT, never compared across hosts.

    ``incarnation`` is the sending channel's (its echo carries the echoing channel's): new per channel, so a
    peer id whose process restarted, even at the same address, is told apart from its earlier life. A channel
    sends one first on every new path to a peer, so it is the first thing a peer hears of each life."""

    seq: NonNeg
    sent_ns: NonNeg
    incarnation: Incarnation


class Bye(_Tagged, frozen=True, forbid_unknown_fields=True, tag="bye"):
    """The sender closes its channel: its peers drop it now (an expected loss, logged as such), instead of
    learning it from a failed send or a missed deadline."""


class Reset(_Tagged, frozen=True, forbid_unknown_fields=True, tag="reset"):
    """The sender had declared the receiver lost (``reason``: nothing heard for its deadline, or a send failed)
    and dropped what it held about it; it hears it again now. The receiver drops what it holds about the sender
    (handshake, links, requests waiting for it) and shakes hands again: e.g. a process stopped longer than the
    sender's deadline, whose own clock left the stop out and which lost no one itself.

    ``incarnation`` is the RECEIVER's: the life of its peer id the sender lost (never 0). A channel acts on a
    Reset only if it names its own incarnation; another life under that peer id (a process restarted, which the
    sender connects to before it heard a frame of it) never held anything of the sender's, and ignores it."""

    reason: Text
    incarnation: LostIncarnation


Message: TypeAlias = (
    Handshake | HandshakeAck | PullRequest | PushOffer | Announce | Ack | Ready | Done | ErrorMsg | Heartbeat | Bye
    | Reset
)


class Envelope(_Body, frozen=True, forbid_unknown_fields=True):
    """What one frame carries: the sender's peer id, its message id, the id replied to, and the body."""

    sender: Id
    msg_id: NonNeg
    reply_to: NonNeg | None
    body: Message
