"""ncclkv.protocol: round trips, strict decoding of every kind of bad frame, handshake checks."""

from __future__ import annotations

import copy
import time

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ncclkv import errors
from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.layout._plan import plan
from ncclkv.protocol import (
    INCARNATION_RANDOM_BITS,
    MAX_HOLD,
    MAX_SHAPE_DIMS,
    PROTOCOL_VERSION,
    Ack,
    Announce,
    Bye,
    Done,
    Envelope,
    ErrorCode,
    ErrorMsg,
    GeometryMsg,
    Handshake,
    HandshakeAck,
    Heartbeat,
    LayoutMsg,
    PullRequest,
    Ready,
    Reset,
    RouteMsg,
    check_compatible,
    decode,
    encode,
)

ROUTE = RouteMsg(0, 1, (0, 16), (2, 4), (0, 128))


def handshake(**changes: object) -> Handshake:
    fields = dict(
        engine_id="prefill-0",
        role="producer",
        rank=1,
        layout=ParallelLayout(2, 1),
        geometry=KVGeometry(16, 8, 128, "bfloat16"),
        control_addr="tcp://127.0.0.1:5555",
        data_addr="127.0.0.1:6666",
    )
    fields.update(changes)
    return Handshake.create(**fields)  # type: ignore[arg-type]


EXAMPLES = [
    handshake(),
    Handshake("e", "both", 0, LayoutMsg(1, 2, (3, 1)), GeometryMsg(4, 1, 576, "float16", True), "float16", 7, "tcp://h:1", "h:2", "abc", True, 2**63 - 1),
    HandshakeAck("decode-0", 0, True, ""),
    HandshakeAck("decode-0", 3, False, "num_kv_heads mismatch"),
    PullRequest("req-1", 0, "decode-0", (ROUTE, RouteMsg(1, 0, (16, 32), (0, 2), (5, 5))), 128),
    PullRequest("req-1", 0, "decode-0", (), 128, 2**63 - 1),
    Announce("req-1", 3, ROUTE, (2, 128, 2, 128), "bfloat16", 2 * 128 * 2 * 128 * 2, 42, "kv-0123"),
    Ack("req-1", 42),
    Ack("req-1", None),
    Ready("req-1"),
    Done("req-1", 16, 1 << 20),
    ErrorMsg("req-1", ErrorCode.CAPACITY, "staging full"),
    ErrorMsg(None, ErrorCode.PROTOCOL, "garbage"),
    Heartbeat(9, 123456789, 77),
    Bye(),
    Reset("nothing heard for more than deadline_s=3.0s", 0x5EED),
    Reset("", 2**63 - 1),
]


@pytest.mark.parametrize("body", EXAMPLES, ids=lambda b: type(b).__name__)
def test_every_message_round_trips(body: object) -> None:
    for reply_to in (None, 7):
        envelope = Envelope("peer-a", 5, reply_to, body)  # type: ignore[arg-type]
        decoded = decode(encode(envelope))
        assert decoded == envelope
        assert type(decoded.body) is type(body)


ids = st.text(min_size=1, max_size=12)
nonneg = st.integers(min_value=0, max_value=2**63)
positive = st.integers(min_value=1, max_value=4096)
incarnations = st.integers(min_value=0, max_value=2**63 - 1)
holds = st.integers(min_value=0, max_value=MAX_HOLD)
pairs = st.tuples(nonneg, nonneg).map(lambda p: (min(p), max(p)))
routes = st.builds(RouteMsg, nonneg, nonneg, pairs, pairs, pairs)
layouts = st.builds(LayoutMsg, positive, positive, st.none() | st.lists(positive, max_size=4).map(tuple))
geometries = st.builds(GeometryMsg, positive, positive, positive, st.sampled_from(["bfloat16", "float8_e4m3fn"]), st.booleans())
bodies = st.one_of(
    st.builds(Handshake, ids, st.sampled_from(["producer", "consumer", "both"]), nonneg, layouts, geometries, ids, nonneg, ids, ids,
              incarnation=incarnations),
    st.builds(HandshakeAck, ids, nonneg, st.booleans(), st.text(max_size=40)),
    st.builds(PullRequest, ids, nonneg, ids, st.lists(routes, max_size=4).map(tuple), nonneg, holds),
    st.builds(Announce, ids, nonneg, routes, st.lists(nonneg, max_size=MAX_SHAPE_DIMS).map(tuple), ids, nonneg, nonneg, ids,
              st.none() | pairs),
    st.builds(Ack, ids, st.none() | nonneg),
    st.builds(Ready, ids),
    st.builds(Done, ids, nonneg, nonneg),
    st.builds(ErrorMsg, st.none() | ids, st.sampled_from(list(ErrorCode)), st.text(max_size=40)),
    st.builds(Heartbeat, nonneg, nonneg, incarnations),
    st.just(Bye()),
    st.builds(Reset, st.text(max_size=40), st.integers(min_value=1, max_value=2**63 - 1)),
)


@given(st.builds(Envelope, ids, nonneg, st.none() | nonneg, bodies))
def test_generated_messages_round_trip(envelope: Envelope) -> None:
    assert decode(encode(envelope)) == envelope


# -- strict decoding: build the frame by hand so the bad value really is on the wire ---------

GOOD = Envelope("peer-a", 5, None, Announce("req-1", 3, ROUTE, (2, 4, 1, 8), "bfloat16", 128, 42, "kv-0123"))


def frame_with(mutate) -> bytes:  # type: ignore[no-untyped-def]
    raw = copy.deepcopy(msgspec.to_builtins(GOOD))
    mutate(raw)
    return msgspec.msgpack.encode(raw)


def _set(path: str, value: object):  # type: ignore[no-untyped-def]
    def mutate(raw: dict) -> None:  # type: ignore[type-arg]
        *parents, last = path.split(".")
        for key in parents:
            raw = raw[key]
        raw[last] = value

    return mutate


def _delete(path: str):  # type: ignore[no-untyped-def]
    def mutate(raw: dict) -> None:  # type: ignore[type-arg]
        *parents, last = path.split(".")
        for key in parents:
            raw = raw[key]
        del raw[last]

    return mutate


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (_set("body.type", "nope"), "Invalid value 'nope'"),
        (_delete("body.type"), "type"),
        (_set("body.layer", "3"), "Expected `int`, got `str` - at `$.body.layer`"),
        (_set("body.layer", True), "Expected `int`, got `bool`"),
        (_set("body.layer", -1), ">= 0"),
        (_set("msg_id", 1.5), "$.msg_id"),
        (_set("reply_to", "x"), "$.reply_to"),
        (_delete("body.seq"), "missing required field `seq`"),
        (_delete("reply_to"), "missing required field `reply_to`"),
        (_set("body.extra", 1), "unknown field `extra`"),
        (_set("extra", 1), "unknown field `extra`"),
        (_set("body.route.layers", [9, 3]), "RouteMsg.layers needs start <= stop, got (9, 3)"),
        (_set("body.route.heads", [1, 2, 3]), "$.body.route.heads"),
        (_set("body.shape", [1] * (MAX_SHAPE_DIMS + 1)), f"length <= {MAX_SHAPE_DIMS}"),
        (_set("body.shape", [2, -4]), "$.body.shape"),
        (_set("body.request_id", ""), "length >= 1"),
        (_set("sender", "x" * 10_000), "$.sender"),
        (_set("body", {"type": "err", "request_id": None, "code": "no_such_code", "text": ""}), "Invalid enum value"),
        (_set("body", {"type": "hs_ack", "engine_id": "e", "rank": 0, "accepted": 1, "reason": ""}), "Expected `bool`"),
    ],
)
def test_malformed_fields_raise_protocol_error(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.ProtocolError, match="malformed control frame") as info:
        decode(frame_with(mutate))
    assert needle in str(info.value)


RESET = Envelope("peer-a", 5, None, Reset("nothing heard for more than deadline_s=3.0s", 0x5EED))


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        # A Reset names the one life of its receiver it is for: never "whichever answers" (protocol 6).
        (_delete("body.incarnation"), "missing required field `incarnation`"),  # a protocol 5 Reset
        (_set("body.incarnation", 0), ">= 1"),
        (_set("body.incarnation", 2**63), "<= 9223372036854775807"),
        (_set("body.incarnation", True), "Expected `int`, got `bool`"),
    ],
)
def test_a_reset_must_name_the_incarnation_it_is_for(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    raw = msgspec.to_builtins(RESET)
    mutate(raw)
    with pytest.raises(errors.ProtocolError, match="malformed control frame") as info:
        decode(msgspec.msgpack.encode(raw))
    assert needle in str(info.value)
    assert decode(encode(RESET)).body == Reset("nothing heard for more than deadline_s=3.0s", 0x5EED)


def test_the_protocol_version_counts_batched_layers_and_hold_numbers() -> None:
    """7 made incarnations grow with their channel's start time (a 6's are random, which a 7 would misorder), 8
    added Announce.num_layers (a 7 refuses its field), 9 PullRequest.hold (an 8 refuses its field), 10 the hold in
    Announce, Done and ErrorMsg (a 9 refuses their field), 11 ErrorCode.REPLACED_LIFE and ErrorMsg.incarnation (a 10
    refuses the field): each refuses the other's handshakes on the version."""
    assert PROTOCOL_VERSION == 11
    for older in (7, 8, 9, 10):
        with pytest.raises(errors.HandshakeError, match=f"protocol_version mismatch: local 11, remote {older}"):
            check_compatible(handshake(), msgspec.structs.replace(handshake(role="consumer"), protocol_version=older))


def test_a_pulls_hold_number_round_trips_defaults_to_0_and_is_bounded() -> None:
    """PullRequest.hold: the hold of the request id a pull or decline is for (0: not named)."""
    assert [f.name for f in msgspec.structs.fields(PullRequest)] == [
        "request_id", "dst_rank", "consumer_engine_id", "routes", "num_tokens", "hold"]
    pull = PullRequest("r", 0, "d", (ROUTE,), 32, hold=7)
    assert decode(encode(Envelope("a", 1, None, pull))).body == pull
    assert PullRequest("r", 0, "d", (), 32).hold == 0  # the default: not named
    raw = msgspec.to_builtins(Envelope("a", 1, None, pull))
    del raw["body"]["hold"]  # absent on the wire: 0
    assert decode(msgspec.msgpack.encode(raw)).body.hold == 0
    for bad in (-1, MAX_HOLD + 1, True, "7"):
        raw["body"]["hold"] = bad
        with pytest.raises(errors.ProtocolError):
            decode(msgspec.msgpack.encode(raw))


@pytest.mark.parametrize("body", [
    Announce("r", 0, ROUTE, (2, 4, 1, 8), "bfloat16", 128, 0, "kv-0", hold=7),
    Done("r", 3, 384, hold=7),
    ErrorMsg("r", ErrorCode.TIMEOUT, "late", hold=7),
], ids=["Announce", "Done", "ErrorMsg"])
def test_what_a_producer_says_of_a_pull_names_its_hold(body: Announce | Done | ErrorMsg) -> None:
    """Announce, Done and ErrorMsg carry the hold number of the pull they answer (0: a push, or not named), so a
    consumer tells an ended pull's late ones from those of the next hold of the id."""
    assert decode(encode(Envelope("a", 1, None, body))).body == body
    assert msgspec.structs.replace(body, hold=0) == type(body)(*[getattr(body, f) for f in body.__struct_fields__
                                                                 if f != "hold"])  # the default: not named
    raw = msgspec.to_builtins(Envelope("a", 1, None, body))
    del raw["body"]["hold"]  # absent on the wire (a push's): 0
    assert decode(msgspec.msgpack.encode(raw)).body.hold == 0
    for bad in (-1, MAX_HOLD + 1, True, "7"):
        raw["body"]["hold"] = bad
        with pytest.raises(errors.ProtocolError):
            decode(msgspec.msgpack.encode(raw))
    assert ErrorMsg.from_exception(errors.TransferTimeout("late"), "r", 7).hold == 7


def test_an_announce_of_several_layers_round_trips_and_counts_at_least_one() -> None:
    stacked = Announce("r", 2, ROUTE, (3, 2, 4, 1, 8), "bfloat16", 3 * 128, 0, "kv-0", num_layers=3)
    assert decode(encode(Envelope("a", 1, None, stacked))).body == stacked
    assert Announce("r", 2, ROUTE, (2, 4, 1, 8), "bfloat16", 128, 0, "kv-0").num_layers == 1  # the default
    with pytest.raises(errors.ProtocolError):  # the wire bounds it like any model dimension
        decode(encode(Envelope("a", 1, None, msgspec.structs.replace(stacked, num_layers=0))))


def test_a_later_channel_has_a_larger_incarnation() -> None:
    from ncclkv.channel import new_incarnation

    first = new_incarnation()
    started_ms = first >> INCARNATION_RANDOM_BITS
    while time.time_ns() // 1_000_000 <= started_ms:  # the next millisecond: the random bits order nothing within one
        pass
    later = [new_incarnation() for _ in range(64)]
    assert all(first < i < 2**63 for i in later) and len(set(later)) > 60
    assert abs((first >> INCARNATION_RANDOM_BITS) - time.time_ns() // 1_000_000) < 60_000


def test_every_truncation_of_a_frame_is_refused() -> None:
    frame = encode(GOOD)
    for cut in range(len(frame)):
        with pytest.raises(errors.ProtocolError):
            decode(frame[:cut])
    with pytest.raises(errors.ProtocolError, match="trailing"):
        decode(frame + b"\x00")


def test_non_map_frames_are_refused() -> None:
    for value in (None, 1, "Announce", [GOOD.sender, 5, None], {"body": None}):
        with pytest.raises(errors.ProtocolError):
            decode(msgspec.msgpack.encode(value))
    with pytest.raises(errors.ProtocolError):
        decode(msgspec.msgpack.encode([[[[[[[[1]]]]]]]] * 3))


@given(st.binary(max_size=256))
def test_random_bytes_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(errors.ProtocolError):
        decode(frame)


def test_oversized_frame_is_refused_before_decoding() -> None:
    frame = encode(GOOD)
    # a well-formed frame over the limit, and garbage over the limit, fail the same way: size first
    for data in (frame, b"\xc1" * len(frame)):
        with pytest.raises(errors.ProtocolError, match=f"{len(frame)} bytes exceeds max_frame_bytes={len(frame) - 1}"):
            decode(data, max_frame_bytes=len(frame) - 1)
    assert decode(frame, max_frame_bytes=len(frame)) == GOOD


def test_encode_refuses_what_the_peer_would_refuse() -> None:
    with pytest.raises(errors.ProtocolError, match=r"Announce would be refused by the peer.*\$\.body\.layer"):
        encode(Envelope("a", 1, None, Announce("r", -1, ROUTE, (1,), "bfloat16", 2, 0, "kv-0")))
    with pytest.raises(errors.ProtocolError, match="Ack would be refused.*seq"):
        encode(Envelope("a", 1, None, Ack("r", "7")))  # type: ignore[arg-type]
    with pytest.raises(errors.ProtocolError, match="cannot encode Heartbeat"):
        encode(Envelope("a", 1, None, Heartbeat(2**70, 0, 1)))
    with pytest.raises(errors.ProtocolError, match="exceeds max_frame_bytes=1024"):
        encode(Envelope("a", 1, None, ErrorMsg(None, ErrorCode.INTERNAL, "x" * 2000)), max_frame_bytes=1024)
    with pytest.raises(TypeError, match="takes an Envelope"):
        encode(Ready("r"))  # type: ignore[arg-type]


def test_route_conversions() -> None:
    route = RouteMsg.from_spans(1, 2, Span(0, 8), Span(2, 4), Span(16, 48))
    assert route == RouteMsg(1, 2, (0, 8), (2, 4), (16, 48))
    assert route.spans() == (Span(0, 8), Span(2, 4), Span(16, 48))
    with pytest.raises(ValueError, match=r"RouteMsg.tokens needs start <= stop, got \(5, 4\)"):
        RouteMsg(0, 0, (0, 1), (0, 1), (5, 4))
    transfer = plan(ParallelLayout(2, 1), ParallelLayout(1, 2), KVGeometry(4, 4, 64), 32)
    for planned in transfer.routes:
        message = decode(encode(Envelope("a", 1, None, PullRequest("r", 0, "d", (RouteMsg.from_route(planned),), 32))))
        (wire,) = message.body.routes  # type: ignore[union-attr]
        assert (wire.src, wire.dst) == (planned.src, planned.dst)
        assert wire.spans() == (planned.layers, planned.heads, planned.tokens)


def test_layout_and_geometry_conversions() -> None:
    for layout in (ParallelLayout(4, 1), ParallelLayout(2, 3, (10, 10, 12))):
        assert LayoutMsg.from_layout(layout).to_layout() == layout
    for geometry in (KVGeometry(32, 8, 128, "float16"), KVGeometry(61, 1, 576, "bfloat16", use_mla=True)):
        assert GeometryMsg.from_geometry(geometry).to_geometry() == geometry
    with pytest.raises(ValueError, match="layer_partition"):
        LayoutMsg(1, 2, (3,)).to_layout()
    with pytest.raises(ValueError, match="dtype 'int4'"):
        GeometryMsg(2, 2, 64, "int4", False).to_geometry()


def test_handshake_create_fills_version_and_wire_dtype() -> None:
    hs = handshake()
    assert hs.protocol_version == PROTOCOL_VERSION
    assert hs.wire_dtype == "bfloat16"
    assert handshake(wire_dtype="float8_e4m3fn").wire_dtype == "float8_e4m3fn"


@pytest.mark.parametrize(
    ("remote", "message"),
    [
        (handshake(role="consumer", geometry=KVGeometry(16, 4, 128)), "num_kv_heads mismatch: local 8, remote 4"),
        (handshake(role="consumer", geometry=KVGeometry(12, 8, 128)),
         "num_layers mismatch: local 16, remote 12 (a speculative drafter's KV layers count as layers: both sides "
         "need the same drafter)"),
        (handshake(role="consumer", geometry=KVGeometry(16, 8, 64)), "head_size mismatch: local 128, remote 64"),
        (handshake(role="consumer", geometry=KVGeometry(16, 8, 128, "float16")), "dtype mismatch: local 'bfloat16', remote 'float16'"),
        (handshake(role="consumer", wire_dtype="float16"), "wire_dtype mismatch: local 'bfloat16', remote 'float16'"),
        (msgspec.structs.replace(handshake(role="consumer"), protocol_version=PROTOCOL_VERSION + 1),
         f"protocol_version mismatch: local {PROTOCOL_VERSION}, remote {PROTOCOL_VERSION + 1}"),
        (handshake(), "role mismatch: local 'producer', remote 'producer'"),
        (handshake(role="consumer", rank=2), "remote rank 2 outside its layout's world_size=2"),
        (handshake(role="consumer", layout=ParallelLayout(3, 1)), "num_kv_heads=8 is neither divisible by nor a divisor of tp_size=3"),
    ],
)
def test_check_compatible_names_both_values(remote: Handshake, message: str) -> None:
    with pytest.raises(errors.HandshakeError, match="handshake with engine 'prefill-0'") as info:
        check_compatible(handshake(), remote)
    assert message in str(info.value)


def test_check_compatible_accepts_heterogeneous_layouts_and_lists_every_mismatch() -> None:
    check_compatible(handshake(), handshake(role="consumer", rank=3, layout=ParallelLayout(1, 4)))
    check_compatible(handshake(role="both"), handshake(role="both"))
    mla = KVGeometry(8, 1, 576, use_mla=True)
    with pytest.raises(errors.HandshakeError) as info:
        check_compatible(handshake(), handshake(role="consumer", geometry=mla, rank=0))
    text = str(info.value)
    for part in ("num_kv_heads mismatch: local 8, remote 1", "use_mla mismatch: local False, remote True", "num_layers mismatch: local 16, remote 8"):
        assert part in text


@pytest.mark.parametrize(
    "error",
    [errors.TransferTimeout, errors.PeerLostError, errors.PeerResetError, errors.ShapeMismatchError,
     errors.CapacityError, errors.HandshakeError, errors.ProtocolError, errors.ClosedError],
)
def test_error_messages_map_to_typed_errors_and_back(error: type[errors.NcclKVError]) -> None:
    wire = decode(encode(Envelope("p", 1, 2, ErrorMsg.from_exception(error("detail 42"), "req-9")))).body
    assert isinstance(wire, ErrorMsg)
    raised = wire.to_exception("prefill-0")
    assert type(raised) is error
    assert "prefill-0" in str(raised) and "req-9" in str(raised) and "detail 42" in str(raised)


def test_a_replaced_life_refusal_names_its_incarnation_and_reads_as_a_duplicate_peer_id() -> None:
    """replaced_life (11): a refusal of a life of the receiver's peer id, naming it in ErrorMsg.incarnation (0 for
    other codes, bounded as every incarnation); read as DuplicatePeerIdError. A DuplicatePeerIdError raised here
    (the loss of a peer) goes out as peer_lost: only a refusal names the receiver's own life."""
    wire = decode(encode(Envelope("p", 1, None, ErrorMsg(None, ErrorCode.REPLACED_LIFE, "r", incarnation=5)))).body
    assert isinstance(wire, ErrorMsg) and (wire.code, wire.incarnation) == (ErrorCode.REPLACED_LIFE, 5)
    assert type(wire.to_exception("b")) is errors.DuplicatePeerIdError
    assert ErrorMsg.from_exception(errors.DuplicatePeerIdError("lost")).code is ErrorCode.PEER_LOST
    assert ErrorMsg(None, ErrorCode.PROTOCOL, "x").incarnation == 0
    raw = msgspec.to_builtins(Envelope("p", 1, None, ErrorMsg(None, ErrorCode.REPLACED_LIFE, "r", incarnation=5)))
    raw["body"]["incarnation"] = -1
    with pytest.raises(errors.ProtocolError, match="malformed control frame"):
        decode(msgspec.msgpack.encode(raw))


def test_untyped_errors_become_internal_and_long_text_is_cut() -> None:
    msg = ErrorMsg.from_exception(KeyError("k" * 10_000))
    assert msg.code is ErrorCode.INTERNAL and msg.request_id is None
    assert msg.text.startswith("KeyError: ") and msg.text.endswith("...")
    decode(encode(Envelope("p", 1, None, msg)))
    raised = ErrorMsg("r", ErrorCode.UNKNOWN_REQUEST, "who?").to_exception("p")
    assert type(raised) is errors.TransferError and "'unknown_request'" in str(raised)


def test_an_announced_piece_is_a_span() -> None:
    good = Announce("r", 0, ROUTE, (2, 4, 1, 8), "bfloat16", 128, 0, "kv-0", piece=(4, 8))
    assert decode(encode(Envelope("a", 1, None, good))).body == good
    with pytest.raises(ValueError, match=r"Announce.piece needs start <= stop, got \(9, 8\)"):
        Announce("r", 0, ROUTE, (2, 4, 1, 8), "bfloat16", 128, 0, "kv-0", piece=(9, 8))
