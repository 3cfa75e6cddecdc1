"""Typed, versioned control messages and their strict msgpack encoding.

Wire format, version :data:`PROTOCOL_VERSION` (checked at the handshake). One ZMQ frame holds one msgpack map,
an :class:`Envelope`::

    {"sender": str, "msg_id": int, "reply_to": int | nil, "body": {"type": TAG, ...}}

``msg_id`` is unique per sender; a reply carries the request's ``msg_id`` in
``reply_to``. ``body`` is one of the tagged messages of :data:`Message` (tags:
``hs hs_ack pull push ann ack ready done err hb bye reset``). ``Heartbeat`` and
``Handshake`` carry the sending channel's ``incarnation`` (new per channel,
growing with its start time, so a peer id restarted is told from its earlier
life, and the later of two lives has the larger one; 0: not given, never
compared); ``Reset`` carries the receiver's, the one life it is for (never 0:
a channel acts only on a Reset naming its own); ``ErrorMsg.incarnation`` names
the life a ``replaced_life`` refusal is for (0: not named, any other code).
``PullRequest.hold`` names the hold of the request id a pull is for (0: not named). Every field is required on
the wire except ``Announce.piece`` (absent: nil, the whole route),
``Announce.num_layers`` (absent: 1) and ``PullRequest.hold`` (absent: 0)
(:func:`encode` always writes them), unknown fields and tags are refused (so a build of an older
version refuses a newer one's frames as malformed, before the handshake could
name the versions), and :func:`decode` checks the frame size before it parses a
byte. What the decoder enforces, beyond types:

* every count, rank, index, size, sequence number and id is an int ``>= 0``
  (``tp_size``, ``pp_size``, layer counts, ``num_layers``, ``num_kv_heads``,
  ``head_size``, ``Reset.incarnation``: ``>= 1``); ``bool`` is not an int here;
* spans (``layers``, ``heads``, ``tokens`` of a route) have ``start <= stop``;
* ``shape`` has at most :data:`MAX_SHAPE_DIMS` dims, each ``>= 0``;
* ``routes`` holds at most :data:`MAX_ROUTES` routes; ``tp_size``, ``pp_size``,
  ``num_layers``, ``num_kv_heads``, ``head_size`` and each ``layer_partition``
  entry are at most :data:`MAX_MODEL_DIM`, the partition at most that long;
* ids and addresses are non-empty strings of at most :data:`MAX_ID_CHARS`
  characters, error text at most :data:`MAX_TEXT_CHARS`;
* ``role`` and ``ErrorMsg.code`` are members of their closed sets.

Cross-field consistency (``nbytes == prod(shape) * itemsize``, a route inside
the layout, a known dtype name) and anything sized by a peer's numbers
(announced ``nbytes`` against staging capacity, token counts against the
request) are the engine's job; handshake compatibility is
:func:`check_compatible`. The whole list is in docs/SECURITY.md.
"""

from __future__ import annotations

import msgspec

from . import _messages
from ._messages import *  # noqa: F403 - the message types and limits, re-exported as listed in _messages.__all__
from ._messages import Envelope, Handshake
from .errors import HandshakeError, ProtocolError

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "check_compatible", "check_encodable_id", "decode", "encode"]
__all__ += _messages.__all__  # one list of the message names: _messages.__all__

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Envelope)
# The largest frame decode() and encode() take unless told (the channel passes its own, NCCLKV_MAX_FRAME_BYTES).
# A literal, not EnvSettings' default: the wire format does not depend on ncclkv._env, which keeps its default
# equal to this one (tests/unit/test_module_rules.py pins the two).
DEFAULT_MAX_FRAME_BYTES = 1 << 20


def decode(frame: bytes | bytearray | memoryview, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Envelope:
    """Parse one frame; any defect (size, bytes, type, field, range) raises :class:`ProtocolError`."""
    size = len(frame)
    if size > max_frame_bytes:
        raise ProtocolError(f"control frame of {size} bytes exceeds max_frame_bytes={max_frame_bytes}")
    try:
        return _DECODER.decode(frame)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"malformed control frame ({size} bytes): {exc}") from None


def encode(envelope: Envelope, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Serialise ``envelope``; raise :class:`ProtocolError` for anything the peer's :func:`decode` would refuse.

    Structs do not type-check on construction, so the frame is decoded once
    here (a few microseconds) and a bad value fails at the sender, naming it.
    """
    if not isinstance(envelope, Envelope):
        raise TypeError(f"encode() takes an Envelope, got {type(envelope).__name__}")
    name = type(envelope.body).__name__
    try:
        frame = _ENCODER.encode(envelope)
    except (msgspec.MsgspecError, TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {name}: {exc}") from None
    try:
        decode(frame, max_frame_bytes)
    except ProtocolError as exc:
        raise ProtocolError(f"{name} would be refused by the peer: {exc}") from None
    return frame


# What a mismatch most often means, beyond a different model.
_HINTS = {"num_layers": " (a speculative drafter's KV layers count as layers: both sides need the same drafter)"}


def check_encodable_id(name: str, value: str) -> None:
    """ValueError naming ``name`` unless the id ``value`` encodes as UTF-8, as the frames' msgpack needs: a lone
    surrogate (JSON's "\\ud800", which json.loads takes) does not, and would fail only on the way out."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be encodable as UTF-8 (what the protocol carries), got {value!r:.80}") from None


def check_compatible(local: Handshake, remote: Handshake) -> None:
    """Raise :class:`HandshakeError` listing every way ``remote`` cannot talk to ``local``.

    Checked: protocol version; geometry (``num_layers``, ``num_kv_heads``,
    ``head_size``, ``use_mla``, ``dtype``) and ``wire_dtype``, which must be
    equal on both sides; roles (two pure producers or two pure consumers have
    nothing to exchange); and that the remote layout is valid, holds the
    geometry and contains the remote rank. Layouts may differ: heterogeneous
    TP/PP is the point. Each problem names both values, e.g.
    ``num_kv_heads mismatch: local 8, remote 4``.
    """
    problems: list[str] = []

    def compare(name: str, mine: object, theirs: object) -> None:
        if mine != theirs:
            problems.append(f"{name} mismatch: local {mine!r}, remote {theirs!r}{_HINTS.get(name, '')}")

    compare("protocol_version", local.protocol_version, remote.protocol_version)
    for name in ("num_layers", "num_kv_heads", "head_size", "use_mla", "dtype"):
        compare(name, getattr(local.geometry, name), getattr(remote.geometry, name))
    compare("wire_dtype", local.wire_dtype, remote.wire_dtype)
    if local.role == remote.role != "both":
        problems.append(f"role mismatch: local {local.role!r}, remote {remote.role!r} (nothing to exchange)")
    if not problems:
        problems.extend(_layout_problems(remote))
    if problems:
        who = f"engine {remote.engine_id!r} rank {remote.rank}"
        raise HandshakeError(f"handshake with {who} refused: " + "; ".join(problems))


def _layout_problems(remote: Handshake) -> list[str]:
    try:
        layout = remote.layout.to_layout()
        layout.check(remote.geometry.to_geometry())
    except ValueError as exc:
        return [f"remote layout {remote.layout} cannot hold remote geometry {remote.geometry}: {exc}"]
    if remote.rank >= layout.world_size:
        return [f"remote rank {remote.rank} outside its layout's world_size={layout.world_size}"]
    return []
