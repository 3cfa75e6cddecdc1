"""Fuzzing the control plane: the decoder, and a live channel's ROUTER.

Malformed frames are generated from the protocol's own schema
(``msgspec.inspect``): a valid envelope is built for any message type, then one
node of it (a field, a list, a nested struct, the body, the whole frame) is
replaced by a value that node's type cannot accept: wrong types, out-of-range
and huge ints, NaN, bytes for str, strings over their limit, lists over their
length, deep nesting, unknown or missing fields, unknown tags. Besides those:
truncations and bit flips of valid frames, random bytes, arbitrary msgpack
values, oversized frames, and (live) messages with the wrong frame count.

The CI size is ``NCCLKV_FUZZ_EXAMPLES`` (default 10,000): that many messages
go to a live channel (``live`` and ``live_hmac`` share them), and as many
again to the decoder alone (the other ``SHARES``); set it higher for a long run.
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import inspect as mi
from zmq.utils.monitor import recv_monitor_message

from ncclkv import errors
from ncclkv._auth import REFUSED_NOTICE
from ncclkv._env import env_settings
from ncclkv.auth import ChannelAuth
from ncclkv.channel import THREAD_PREFIX, Channel
from ncclkv._peers import MAX_LOST_PEERS, Budget, PeerTable
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.protocol import (
    MAX_MODEL_DIM,
    MAX_ROUTES,
    Ack,
    Envelope,
    GeometryMsg,
    Handshake,
    LayoutMsg,
    Message,
    PullRequest,
    Ready,
    RouteMsg,
    decode,
    encode,
)

from _channel_helpers import channel_threads, wait_until

TOTAL = env_settings().fuzz_examples
# Fractions of TOTAL: the decoder-only tests share one TOTAL, the live channel tests another.
SHARES = {"mutated": 0.40, "truncated": 0.10, "bitflip": 0.20, "random": 0.10, "junk": 0.10, "oversized": 0.10,
          "live": 0.80, "live_hmac": 0.20}
INT_MIN, UINT_MAX = -(2**63), 2**64 - 1  # what msgpack can carry
ENVELOPE = mi.type_info(Envelope)
ran: dict[str, int] = {}


def share(name: str) -> int:
    return max(1, round(TOTAL * SHARES[name]))


def fuzz_settings(name: str) -> settings:
    return settings(
        max_examples=share(name),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


# -- valid trees (msgpack builtins) from the schema ------------------------------------

def _per_type(build: Callable[[mi.Type], st.SearchStrategy[object]]) -> Callable[[mi.Type], st.SearchStrategy[object]]:
    """Build each type's strategy once (type infos are unhashable: keyed by id, kept alive)."""
    cache: dict[int, tuple[mi.Type, st.SearchStrategy[object]]] = {}

    def cached(t: mi.Type) -> st.SearchStrategy[object]:
        if id(t) not in cache:
            cache[id(t)] = (t, build(t))
        return cache[id(t)][1]

    return cached


def _bounds(t: mi.IntType) -> tuple[int, int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else INT_MIN)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else UINT_MAX)
    return lo, hi


def _is_span(t: mi.Type) -> bool:
    """A (start, stop) pair: the one cross-field rule the decoder enforces is start <= stop."""
    return isinstance(t, mi.TupleType) and len(t.item_types) == 2 and all(isinstance(x, mi.IntType) for x in t.item_types)


@_per_type
def valid(t: mi.Type) -> st.SearchStrategy[object]:
    if isinstance(t, mi.IntType):
        return st.integers(*_bounds(t))
    if isinstance(t, mi.StrType):
        return st.text(min_size=t.min_length or 0, max_size=min(t.max_length or 12, 12))
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.EnumType):
        return st.sampled_from([member.value for member in t.cls])
    if isinstance(t, mi.UnionType):
        return st.one_of([valid(member) for member in t.types])
    if isinstance(t, mi.VarTupleType):
        return st.lists(valid(t.item_type), min_size=t.min_length or 0, max_size=min(t.max_length or 3, 3))
    if isinstance(t, mi.TupleType):
        items = st.tuples(*(valid(item) for item in t.item_types)).map(list)
        return items.map(sorted) if _is_span(t) else items
    if isinstance(t, mi.StructType):
        fields = {f.encode_name: valid(f.type) for f in t.fields}
        if t.tag_field is not None:
            fields[t.tag_field] = st.just(t.tag)
        return st.fixed_dictionaries(fields)
    raise AssertionError(f"the fuzzer does not know {t!r}: teach valid() and invalid() the new type")


def valid_envelopes(sender: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[dict]:  # type: ignore[type-arg]
    if sender is None:
        return valid(ENVELOPE)  # type: ignore[return-value]
    return st.tuples(valid(ENVELOPE), sender).map(lambda pair: {**pair[0], "sender": pair[1]})  # type: ignore[dict-item]


# -- values a node's type cannot accept --------------------------------------------------

JUNK: dict[str, st.SearchStrategy[object]] = {
    "none": st.none(),
    "bool": st.booleans(),
    "int": st.integers(INT_MIN, UINT_MAX),
    "float": st.floats(allow_nan=True, allow_infinity=True),
    "str": st.text(max_size=8),
    "bytes": st.binary(max_size=8),
    "list": st.lists(st.integers(0, 9), max_size=3),
    "map": st.dictionaries(st.text(max_size=4), st.integers(0, 9), max_size=3),
    "ext": st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8)),
    "deep": st.integers(64, 20_000).map(lambda depth: msgspec.Raw(b"\x91" * depth + b"\xc0")),  # [[[...nil]]]
}


def _accepts(t: mi.Type) -> set[str]:
    """Junk kinds a value of which MAY be valid for ``t`` (so never used as 'invalid')."""
    if isinstance(t, mi.UnionType):
        return set().union(*(_accepts(member) for member in t.types))
    return {
        mi.IntType: {"int"}, mi.StrType: {"str"}, mi.BoolType: {"bool"}, mi.NoneType: {"none"},
        mi.LiteralType: {"str"}, mi.EnumType: {"str"}, mi.VarTupleType: {"list"}, mi.TupleType: {"list"},
    }.get(type(t), set())  # a struct accepts none: every struct has required fields junk maps lack


def _too_long_text(max_length: int) -> st.SearchStrategy[str]:
    near = st.integers(max_length + 1, max_length + 8)
    huge = st.integers(max_length + 9, max(50_000, 2 * max_length))
    return st.tuples(st.one_of(near, huge), st.sampled_from("x\u00e9\U0001f600")).map(lambda p: p[1] * p[0])


@_per_type
def invalid(t: mi.Type) -> st.SearchStrategy[object]:
    """A value of a kind ``t`` cannot hold, or of its kind but out of its bounds."""
    options = [strategy for kind, strategy in JUNK.items() if kind not in _accepts(t)]
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    ints = [m for m in members if isinstance(m, mi.IntType)]
    if len(ints) == 1:  # unions here hold at most one int type
        lo, hi = _bounds(ints[0])
        if lo > INT_MIN:
            options.append(st.integers(INT_MIN, lo - 1))
        if hi < UINT_MAX:
            options.append(st.integers(hi + 1, UINT_MAX))
    for m in members:
        if isinstance(m, mi.StrType) and m.max_length is not None:
            options.append(_too_long_text(m.max_length))
        if isinstance(m, mi.StrType) and m.min_length and not any(isinstance(x, mi.NoneType) for x in members):
            options.append(st.just(""))
        if isinstance(m, mi.LiteralType | mi.EnumType):
            allowed = set(m.values) if isinstance(m, mi.LiteralType) else {e.value for e in m.cls}
            options.append(st.text(max_size=12).filter(lambda s, a=allowed: s not in a))  # type: ignore[misc]
        if isinstance(m, mi.VarTupleType) and m.max_length is not None:
            options.append(valid(m.item_type).map(lambda item, n=m.max_length: [item] * (n + 1)))  # type: ignore[misc]
        if isinstance(m, mi.TupleType):
            items = st.lists(valid(m.item_types[0]), max_size=len(m.item_types) + 2)
            options.append(items.filter(lambda xs, n=len(m.item_types): len(xs) != n))  # type: ignore[misc]
            if _is_span(m):
                options.append(st.tuples(*(valid(x) for x in m.item_types)).filter(lambda p: p[0] != p[1]).map(
                    lambda p: sorted(p, reverse=True)))
    return st.one_of(options)


# -- mutating one node of a valid tree --------------------------------------------------

Path = tuple[object, ...]


def _member(t: mi.Type, value: object) -> mi.Type:
    """The union member ``value`` was generated from (tagged struct by tag, else by kind)."""
    if not isinstance(t, mi.UnionType):
        return t
    for member in t.types:
        if isinstance(member, mi.StructType) and isinstance(value, dict) and value.get(member.tag_field) == member.tag:
            return member
        if isinstance(member, mi.NoneType) and value is None:
            return member
        if isinstance(member, mi.IntType | mi.StrType) and isinstance(value, int | str) and not isinstance(value, bool):
            return member
        if isinstance(member, mi.VarTupleType | mi.TupleType) and isinstance(value, list):
            return member
    raise AssertionError(f"no member of {t!r} for {value!r}")


def nodes(value: object, t: mi.Type, path: Path = ()) -> Iterator[tuple[Path, mi.Type, object]]:
    yield path, t, value
    member = _member(t, value)
    if isinstance(member, mi.StructType):
        assert isinstance(value, dict)
        for f in member.fields:
            yield from nodes(value[f.encode_name], f.type, path + (f.encode_name,))
    elif isinstance(member, mi.VarTupleType | mi.TupleType):
        assert isinstance(value, list)
        for index, item in enumerate(value):
            item_type = member.item_type if isinstance(member, mi.VarTupleType) else member.item_types[index]
            yield from nodes(item, item_type, path + (index,))


def _replace(tree: object, path: Path, new: object) -> object:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, head: _replace(tree[head], rest, new)}
    assert isinstance(tree, list) and isinstance(head, int)
    return tree[:head] + [_replace(tree[head], rest, new)] + tree[head + 1:]


TAGS = frozenset(m.tag for m in ENVELOPE.fields[3].type.types)  # type: ignore[attr-defined]
not_a_field = st.text(min_size=1, max_size=8)


def _struct_damage(draw: st.DrawFn, t: mi.StructType, value: dict) -> dict:  # type: ignore[type-arg]
    """Drop a required field, add an unknown one, or (tagged) give an unknown tag."""
    names = [f.encode_name for f in t.fields] + ([t.tag_field] if t.tag_field else [])
    # Only a required field: a frame without one that has a default (Announce.piece, .num_layers) is valid.
    required = [f.encode_name for f in t.fields if f.required] + ([t.tag_field] if t.tag_field else [])
    how = draw(st.sampled_from(["drop", "extra", "tag"] if t.tag_field else ["drop", "extra"]))
    if how == "drop":
        name = required[draw(st.integers(0, len(required) - 1))]
        return {k: v for k, v in value.items() if k != name}
    if how == "extra":
        return {**value, draw(not_a_field.filter(lambda k: k not in names)): draw(JUNK["int"])}
    return {**value, t.tag_field: draw(JUNK["str"].filter(lambda s: s not in TAGS))}  # type: ignore[dict-item]


@st.composite
def mutated_frames(draw: st.DrawFn, sender: st.SearchStrategy[str] | None = None) -> bytes:
    tree = draw(valid_envelopes(sender))
    all_nodes = list(nodes(tree, ENVELOPE))
    path, t, value = all_nodes[draw(st.integers(0, len(all_nodes) - 1))]
    member = _member(t, value)
    if isinstance(member, mi.StructType) and draw(st.booleans()):
        new = _struct_damage(draw, member, value)  # type: ignore[arg-type]
    else:
        new = draw(invalid(t))
    return msgspec.msgpack.encode(_replace(tree, path, new))


def valid_frames(sender: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[bytes]:
    return valid_envelopes(sender).map(msgspec.msgpack.encode)


@st.composite
def truncated_frames(draw: st.DrawFn, sender: st.SearchStrategy[str] | None = None) -> bytes:
    frame = draw(valid_frames(sender))
    return frame[: draw(st.integers(0, len(frame) - 1))]


@st.composite
def bit_flipped_frames(draw: st.DrawFn, sender: st.SearchStrategy[str] | None = None) -> bytes:
    frame = bytearray(draw(valid_frames(sender)))
    for bit in draw(st.lists(st.integers(0, 8 * len(frame) - 1), min_size=1, max_size=8)):
        frame[bit // 8] ^= 1 << (bit % 8)
    return bytes(frame)


msgpack_junk = st.recursive(
    st.one_of(list(JUNK.values())),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
).map(msgspec.msgpack.encode)
random_bytes = st.binary(max_size=600)
DECODE_LIMIT = 4096  # the decoder tests' max_frame_bytes, so oversized frames stay cheap


@st.composite
def oversized_frames(draw: st.DrawFn) -> bytes:
    size = draw(st.integers(DECODE_LIMIT + 1, 4 * DECODE_LIMIT))
    frame = draw(st.one_of(valid_frames(), random_bytes))
    return (frame + draw(st.binary(min_size=1, max_size=64)) * size)[:size]


# -- (a) the decoder ----------------------------------------------------------------------

def _refused(name: str, frame: bytes, max_frame_bytes: int = 1 << 20) -> None:
    with pytest.raises(errors.ProtocolError):  # anything else escaping fails the test
        decode(frame, max_frame_bytes)
    ran[name] = ran.get(name, 0) + 1


@pytest.mark.parametrize(
    ("name", "strategy", "limit"),
    [
        pytest.param("mutated", mutated_frames(), 1 << 20, id="mutated"),
        pytest.param("truncated", truncated_frames(), 1 << 20, id="truncated"),
        pytest.param("random", random_bytes, 1 << 20, id="random"),
        pytest.param("junk", msgpack_junk, 1 << 20, id="junk"),
        pytest.param("oversized", oversized_frames(), DECODE_LIMIT, id="oversized"),
    ],
)
def test_decoder_refuses_every_malformed_frame(name: str, strategy: st.SearchStrategy[bytes], limit: int) -> None:
    @fuzz_settings(name)
    @given(strategy)
    def check(frame: bytes) -> None:
        _refused(name, frame, limit)

    ran[name] = 0
    check()
    assert ran[name] >= share(name)


def test_decoder_survives_bit_flips() -> None:
    outcomes = {"refused": 0, "still_valid": 0}

    @fuzz_settings("bitflip")
    @given(bit_flipped_frames())
    def check(frame: bytes) -> None:
        try:
            envelope = decode(frame)
        except errors.ProtocolError:
            outcomes["refused"] += 1
            return
        assert decode(encode(envelope)) == envelope  # a flip that left it valid left it fully valid
        outcomes["still_valid"] += 1

    check()
    assert sum(outcomes.values()) >= share("bitflip") and outcomes["refused"] > 0


@settings(max_examples=200, deadline=None)
@given(valid_frames())
def test_the_generator_knows_the_schema(frame: bytes) -> None:
    """The fuzzer's valid trees decode: so its mutations start from real messages."""
    assert isinstance(decode(frame), Envelope)


def test_counts_from_peers_are_bounded() -> None:
    route = RouteMsg(0, 0, (0, 1), (0, 1), (0, 16))
    at_limit = Envelope("p", 1, None, PullRequest("r", 0, "d", (route,) * MAX_ROUTES, 16))
    assert decode(encode(at_limit)) == at_limit
    with pytest.raises(errors.ProtocolError, match=f"length <= {MAX_ROUTES}"):
        encode(Envelope("p", 1, None, PullRequest("r", 0, "d", (route,) * (MAX_ROUTES + 1), 16)))
    hello = Handshake.create("e", "consumer", 0, ParallelLayout(1, 1), KVGeometry(2, 2, 64), "tcp://h:1", "h:2")
    over = MAX_MODEL_DIM + 1
    for changes in ({"layout": LayoutMsg(over, 1, None)}, {"layout": LayoutMsg(1, 1, (1,) * over)},
                    {"geometry": GeometryMsg(over, 1, 64, "bfloat16", False)},
                    {"geometry": GeometryMsg(2, 2, over, "bfloat16", False)}):
        # the encoder does not validate: this frame holds exactly the out-of-bound value
        frame = msgspec.msgpack.encode(Envelope("p", 1, None, msgspec.structs.replace(hello, **changes)))
        with pytest.raises(errors.ProtocolError, match=f"<= {MAX_MODEL_DIM}"):
            decode(frame)


def test_one_shot_peers_do_not_grow_the_peer_table() -> None:
    table = PeerTable()
    for index in range(MAX_LOST_PEERS + 10):
        table.heard(f"p{index}", 0.0)
        assert table.mark_lost(f"p{index}", "test")
    with pytest.raises(ValueError, match="unknown peer 'p0'"):  # the oldest lost peers were forgotten
        table.require_alive("p0")
    with pytest.raises(errors.PeerLostError):  # the recent ones are still reported as lost
        table.require_alive(f"p{MAX_LOST_PEERS + 9}")


def test_budget_grants_a_burst_then_its_rate() -> None:
    budget = Budget(per_s=10.0, burst=3.0)
    assert [budget.take(0.0) for _ in range(5)] == [True, True, True, False, False]
    assert budget.take_refused() == 2 and budget.take_refused() == 0
    assert budget.take(0.1) and not budget.take(0.1)  # one token back after 0.1 s at 10/s
    granted = sum(budget.take(1.0 + i / 100) for i in range(100))  # a full burst, then 10 per second
    assert 3 + 9 <= granted <= 3 + 10


# -- (b) a live channel ---------------------------------------------------------------------

LIVE_LIMIT = 16 * 1024  # the live server's max_frame_bytes
SOCKET_LIMIT = 2 * LIVE_LIMIT + 1024  # larger frames make ZMQ drop the connection, and what it still carried
RAW_IDS = (b"fuzz-0", b"fuzz-1", b"fuzz-2")
SECRET = b"s" * 32
not_a_raw_id = st.text(max_size=8).map(lambda s: "peer-" + s)  # frames never name the dealer they come from


@st.composite
def live_oversized(draw: st.DrawFn) -> bytes:
    size = draw(st.integers(LIVE_LIMIT + 1, SOCKET_LIMIT))
    return (draw(valid_frames(not_a_raw_id)) + draw(st.binary(min_size=1, max_size=16)) * size)[:size]


live_messages = st.one_of(
    st.one_of(
        mutated_frames(not_a_raw_id), truncated_frames(not_a_raw_id), bit_flipped_frames(not_a_raw_id),
        random_bytes, msgpack_junk, live_oversized(), valid_frames(not_a_raw_id), st.just(b""),
    ).map(lambda frame: [frame]),
    st.lists(st.one_of(valid_frames(not_a_raw_id), random_bytes), min_size=2, max_size=5),  # wrong frame count
).filter(lambda parts: all(len(part) <= SOCKET_LIMIT for part in parts))  # larger: see the last test


def ncclkv_bytes() -> int:
    """Bytes allocated by ncclkv's own code and still alive."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/ncclkv/*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.mark.parametrize("mode", ["live", "live_hmac"])
def test_live_channel_rejects_every_frame_and_keeps_serving(mode: str) -> None:
    messages: list[list[bytes]] = []

    @fuzz_settings(mode)
    @given(live_messages)
    def collect(parts: list[bytes]) -> None:
        messages.append(parts)

    collect()
    assert len(messages) >= share(mode)
    auth = ChannelAuth(shared_secret=SECRET) if mode == "live_hmac" else ChannelAuth()
    seen: list[tuple[str, Message]] = []

    def handle(sender: str, body: Message) -> Message | None:
        seen.append((sender, body))
        return Ack(body.request_id, None) if isinstance(body, Ready) else None  # type: ignore[union-attr]

    context = zmq.Context()
    raws = []
    server = Channel("server", on_message=handle, max_frame_bytes=LIVE_LIMIT, auth=auth)
    good = Channel("good", auth=auth)
    try:
        for routing_id in RAW_IDS:
            raw = context.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.SNDTIMEO, 10_000)  # a send that cannot complete fails instead of hanging
            raw.setsockopt(zmq.ROUTING_ID, routing_id)
            raw.connect(server.address)
            raws.append(raw)
        good.connect("server", server.address)
        assert good.request("server", Ready("warm-up"), timeout_s=10) == Ack("warm-up", None)
        sent = replies = requests = 0
        answers: set[bytes] = set()
        tracemalloc.start()
        before = ncclkv_bytes()
        started = time.monotonic()
        for index, parts in enumerate(messages):
            raw_id = RAW_IDS[index % len(RAW_IDS)]
            if len(parts) == 1 and _names(parts[0], raw_id):
                continue  # would be a good frame from that dealer: never generated, but never counted either
            raws[index % len(raws)].send_multipart(parts)
            sent += 1
            if index % 40 == 0:  # a well-formed peer keeps being served in the middle of it all
                requests += 1
                assert good.request("server", Ready(f"r{index}"), timeout_s=10) == Ack(f"r{index}", None)
            replies += sum(_drain(raw, answers) for raw in raws)
        wait_until(lambda: server.stats.rejected >= sent, timeout_s=30.0)
        assert good.request("server", Ready("last"), timeout_s=10) == Ack("last", None)
        elapsed = time.monotonic() - started
        replies += sum(_drain(raw, answers) for raw in raws)
        grown = ncclkv_bytes() - before
        tracemalloc.stop()

        stats = server.stats
        print(f"\n[fuzz] {mode}: {sent} malformed messages to a live channel in {elapsed:.1f} s, all rejected")
        assert sent >= share(mode) and stats.rejected == sent and stats.handler_errors == 0
        assert stats.received == requests + 2 and {sender for sender, _ in seen} == {"good"}  # fuzz never dispatched
        if mode == "live_hmac":
            # Dropped before decoding, answered by the fixed notice alone: nothing of the frame or the server in it
            assert stats.auth_failures == sent and answers == {REFUSED_NOTICE}
        assert 0 < replies <= 100 + 50 * elapsed + 5  # answers to bad frames are rate limited
        assert sorted(channel_threads()) == [f"{THREAD_PREFIX}-dispatch[good]", f"{THREAD_PREFIX}-dispatch[server]",
                                             f"{THREAD_PREFIX}-io[good]", f"{THREAD_PREFIX}-io[server]"]
        assert grown < 256 * 1024, f"ncclkv holds {grown} more bytes after {sent} rejected frames"
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        for raw in raws:
            raw.close()
        context.term()
        good.close()
        server.close()
    assert channel_threads() == []


def _names(frame: bytes, routing_id: bytes) -> bool:
    try:
        return decode(frame, LIVE_LIMIT).sender.encode() == routing_id
    except errors.ProtocolError:
        return False


def _drain(raw: zmq.Socket, answers: set[bytes]) -> int:
    """How many frames wait on ``raw``; each one's bytes (the last part) go into ``answers``."""
    count = 0
    while raw.poll(0):
        answers.add(raw.recv_multipart()[-1])
        count += 1
    return count


def test_frames_over_the_socket_limit_drop_only_that_connection() -> None:
    """Over twice max_frame_bytes, ZMQ closes the sender's connection before buffering the frame."""
    with Channel("server", on_message=lambda s, b: Ack(b.request_id, None) if isinstance(b, Ready) else None,
                 max_frame_bytes=LIVE_LIMIT) as server, Channel("good") as good:
        good.connect("server", server.address)
        context = zmq.Context()
        raw = context.socket(zmq.DEALER)
        monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(server.address)
            raw.send(random.randbytes(SOCKET_LIMIT + 1))
            assert monitor.poll(10_000), "the server never dropped the connection"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert good.request("server", Ready("still"), timeout_s=10) == Ack("still", None)
            assert server.stats.rejected == 0 and server.stats.received == 1
        finally:
            raw.disable_monitor()
            monitor.close(linger=0)
            raw.close(linger=0)
            context.term()
