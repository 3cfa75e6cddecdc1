"""Process bodies of the multi-process engine tests: one spawned process per engine rank, driven by commands.

:func:`serve` runs in the child. It reads ``(command, kwargs)`` from its pipe,
runs the command against the engine ranks it built (normally one), and
answers ``("ok", result)`` or ``("error", traceback)``. Progress that the test
must see while a command is still running (a producer parked before its last
layer, a fault hook reached) goes to the ``notes`` queue; the only things a
child ever waits for from outside are its own ``gate`` event and, for a link
``hold_link`` holds, the ``release_link`` command, always with a deadline. Request outcomes come back as :class:`Outcome` values stamped with
``time.monotonic()``, which is one clock for every process of the machine, so
the test can time a failure against the moment it killed a peer.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import torch

import ncclkv._messages as messages
import ncclkv.engine._engine as engine_module
from ncclkv.channel import Channel
from ncclkv.engine import EngineRef
from ncclkv.layout import KVGeometry, ParallelLayout, Span, SpanSet
from ncclkv.paged import CacheLayout
from ncclkv.protocol import Announce, Handshake, Message
from ncclkv.scenario._kv import read_tokens

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:  # kvsim lives in tests/engine (pytest puts tests/ on the path; a spawned child may not)
    sys.path.insert(0, _TESTS)
from engine.kvsim import RankSide  # noqa: E402

from _commands import commands  # noqa: E402

__all__ = ["Outcome", "Req", "serve", "thread_names"]

IDLE_S = 300.0  # a child whose parent vanished exits after this long without a command
STALL_S = 60.0  # how long a fault hook holds its thread; the test kills the process long before
POLL_S = 0.005


@dataclass(frozen=True, slots=True)
class Req:
    """One request: its KV is ``global_kv(seed, layer)``; tokens ``first..num_tokens`` move."""

    rid: str
    seed: int
    num_tokens: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    first: int = 0  # the consumer already holds tokens [0, first): a partial prefix

    @property
    def tokens(self) -> SpanSet | int:
        return SpanSet.range(self.first, self.num_tokens) if self.first else self.num_tokens


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended on one rank. ``reported``: what take_finished_* said ("" = success)."""

    error_type: str | None
    message: str
    at: float
    mismatches: tuple[str, ...] = ()
    reported: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None and not self.mismatches and self.reported == ""


@dataclass
class _State:
    notes: Any  # multiprocessing Queue
    gate: Any  # multiprocessing Event
    sides: dict[str, RankSide] = field(default_factory=dict)
    received: dict[str, dict[str, BaseException | None]] = field(default_factory=dict)
    sent: dict[str, dict[str, BaseException | None]] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)  # never set: stalled hooks time out
    link_gate: threading.Event = field(default_factory=threading.Event)  # a link held by hold_link goes on once set


def thread_names() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("ncclkv"))


def _error_name(error: BaseException | None) -> str:
    return "" if error is None else type(error).__name__


def _poll(what: str, timeout_s: float, ready: Callable[[], bool]) -> float:
    """Wait for a condition of this process's engine (no blocking variant exists); return when it held."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s")
        threading.Event().wait(POLL_S)
    return time.monotonic()


# -- commands --------------------------------------------------------------------------------


def build(st: _State, key: str, engine_id: str, rank: int, layout: ParallelLayout, geometry: KVGeometry,
          cache_layout: CacheLayout, block_size: int, role: str, num_blocks: int = 32,
          protocol_version: int | None = None, control_port: int = 0, **config: Any) -> str:
    """Build an engine rank with sentinel-filled caches; return its control address. ``control_port``: bind its
    channel there (``Channel(port=...)``), e.g. the port of a process it restarts."""
    saved, saved_channel = messages.PROTOCOL_VERSION, engine_module.Channel
    if protocol_version is not None:  # stands in for a build of another protocol version
        messages.PROTOCOL_VERSION = protocol_version
    if control_port:
        engine_module.Channel = functools.partial(Channel, port=control_port)  # type: ignore[misc]
    try:
        side = RankSide.build(engine_id, rank, layout, geometry, cache_layout, block_size, num_blocks, role, **config)
    finally:
        messages.PROTOCOL_VERSION, engine_module.Channel = saved, saved_channel
    st.sides[key] = side
    st.received[key], st.sent[key] = {}, {}
    return side.engine.address


def hold(st: _State, key: str, reqs: list[Req]) -> None:
    """Producer, pull mode: write each request's KV and hold its blocks for the consumers."""
    side = st.sides[key]
    for req in reqs:
        side.fill(req.seed, list(req.src_blocks), req.num_tokens)
        side.engine.finish(req.rid, list(req.src_blocks), req.num_tokens)


def expect(st: _State, key: str, producer: EngineRef, reqs: list[Req], push: bool = False) -> None:
    engine = st.sides[key].engine
    for req in reqs:
        engine.expect(req.rid, producer, list(req.dst_blocks), req.num_tokens if push else req.tokens, push=push)


def wait(st: _State, key: str, reqs: list[Req], timeout_s: float = 30.0) -> dict[str, Outcome]:
    """Consumer: wait for each request, check its tokens byte for byte, and what take_finished_receiving says."""
    side, seen = st.sides[key], st.received[key]
    out: dict[str, Outcome] = {}
    for req in reqs:
        error: BaseException | None = None
        if req.rid in seen:  # already taken as finished while polling for an earlier request
            error = seen[req.rid]
        else:
            try:
                side.engine.wait(req.rid, timeout_s)
            except Exception as err:  # noqa: BLE001 - the outcome under test
                error = err
        at = time.monotonic()
        bad = () if error else tuple(side.mismatches(req.seed, list(req.dst_blocks), req.num_tokens,
                                                     Span(req.first, req.num_tokens)))
        try:
            _poll(f"{req.rid} in take_finished_receiving", timeout_s,
                  lambda: seen.update(side.engine.take_finished_receiving()) or req.rid in seen)
            reported: str | None = _error_name(seen[req.rid])
        except TimeoutError:
            reported = None
        message = "" if error is None else str(error)
        out[req.rid] = Outcome(None if error is None else type(error).__name__, message, at, bad, reported)
    return out


def wait_layer(st: _State, key: str, req: Req, layer: int, probe_layer: int, timeout_s: float = 30.0) -> str:
    """Wait for ``layer`` alone, then say what ``probe_layer`` holds: "landed", "empty" (sentinel) or "partial"."""
    side = st.sides[key]
    side.engine.wait_layer(req.rid, layer, timeout_s)
    got = read_tokens(side.caches[probe_layer], side.cache_layout, list(req.dst_blocks), Span(0, req.num_tokens),
                      Span(0, len(side.shard.heads)))
    if bool((got == -7.0).all()):
        return "empty"
    return "partial" if side.mismatches(req.seed, list(req.dst_blocks), req.num_tokens, Span(0, req.num_tokens)) \
        else "landed"


def take_sent(st: _State, key: str, rids: list[str], timeout_s: float = 30.0) -> dict[str, Outcome]:
    """Producer: wait until take_finished_sending reported every request in ``rids``."""
    engine, seen = st.sides[key].engine, st.sent[key]
    for rid in rids:
        _poll(f"{rid} in take_finished_sending", timeout_s,
              lambda: seen.update(engine.take_finished_sending()) or rid in seen)
    return {rid: Outcome(_error_name(seen[rid]) or None, str(seen[rid] or ""), time.monotonic(),
                         reported=_error_name(seen[rid])) for rid in rids}


def push(st: _State, key: str, req: Req, consumer: EngineRef, gate_after: int | None = None,
         resume: str = "gate", timeout_s: float = 30.0) -> Outcome:
    """Producer, push mode: save layer by layer. After layer ``gate_after`` post ("parked", rid) and wait for
    the gate (``resume="gate"``) or until the consumer is lost (``resume="lost"``); then the rest, finish,
    and wait for the request's outcome."""
    side = st.sides[key]
    side.fill(req.seed, list(req.src_blocks), req.num_tokens)
    side.engine.start_push(req.rid, consumer, list(req.src_blocks), req.num_tokens)
    for layer in side.shard.layers:
        side.engine.save_layer(req.rid, layer)
        if layer == gate_after:
            st.notes.put(("parked", req.rid, layer))
            if resume == "gate":
                if not st.gate.wait(timeout_s):
                    raise TimeoutError(f"{req.rid}: gate not opened within {timeout_s}s")
                st.gate.clear()
            else:
                peers = [consumer.peer_id(r) for r in range(consumer.layout.world_size)]
                channel = side.engine._channel  # the offers run on the engine's executor: first see them alive
                _poll(f"{peers} connected", timeout_s, lambda: all(channel.peer_alive(p) for p in peers))
                _poll(f"{peers} lost", timeout_s, lambda: not any(channel.peer_alive(p) for p in peers))
            st.notes.put(("resumed", req.rid, time.monotonic()))
    side.engine.finish(req.rid)
    return take_sent(st, key, [req.rid], timeout_s)[req.rid]


def start_push(st: _State, key: str, req: Req, consumer: EngineRef) -> None:
    """Producer, push mode: start the push, save every layer and finish; returns at once (``take_sent`` reports
    it), so the process takes other commands while the push waits for its consumer."""
    side = st.sides[key]
    side.fill(req.seed, list(req.src_blocks), req.num_tokens)
    side.engine.start_push(req.rid, consumer, list(req.src_blocks), req.num_tokens)
    for layer in side.shard.layers:
        side.engine.save_layer(req.rid, layer)
    side.engine.finish(req.rid)


def stall(st: _State, key: str, phase: str, rid: str = "", layer: int = 0) -> None:
    """Fault hook: on the next handshake (before any reply), or right after announcing ``layer`` of ``rid``
    (before posting its tensor), post ("stalled", phase) and hold that thread until the process is killed."""
    engine = st.sides[key].engine

    def hold_here() -> None:
        st.notes.put(("stalled", phase))
        st.release.wait(STALL_S)

    if phase == "handshake":
        on_handshake = engine._peers.on_handshake

        def stalled_handshake(sender: str, remote: Handshake) -> Handshake:
            hold_here()
            return on_handshake(sender, remote)

        engine._peers.on_handshake = stalled_handshake  # type: ignore[method-assign]
    elif phase == "announce":
        send = engine._channel.send

        def stalled_send(peer_id: str, body: Message, reply_to: int | None = None) -> int:
            msg_id = send(peer_id, body, reply_to)
            if isinstance(body, Announce) and body.request_id == rid and body.layer == layer:
                hold_here()  # on the link's send thread: the announced tensor is never posted
            return msg_id

        engine._channel.send = stalled_send  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown phase {phase!r}")


def hold_link(st: _State, key: str, after_open: bool = False) -> None:
    """Fault hook: hold the next link this engine rank opens (either end), on its opening thread, until
    ``release_link`` (or ``close_all``); ("link held", peer id) is posted as it is held. Before its rendezvous
    (``after_open=False``: the peer's end waits for ours, as if this process stalled right after answering the
    handshake), or after it (``after_open=True``: the peer's end is open, ours opened but not yet settled)."""
    peers = st.sides[key].engine._peers
    open_link = peers._open_link
    armed, lock = [True], threading.Lock()
    st.link_gate.clear()

    def hold_here(peer_id: str) -> None:
        st.notes.put(("link held", peer_id))
        st.link_gate.wait(STALL_S)

    def held_open(peer_id: str, store_addr: str, session: str) -> Any:
        with lock:
            first, armed[0] = armed[0], False
        if first and not after_open:
            hold_here(peer_id)
        link = open_link(peer_id, store_addr, session)
        if first and after_open:
            hold_here(peer_id)
        return link

    peers._open_link = held_open  # type: ignore[method-assign]


def release_link(st: _State) -> None:
    """Let the link held by ``hold_link`` go on."""
    st.link_gate.set()


def note_handling(st: _State, key: str, what: str, sender: str) -> None:
    """Post ("handling", what, sender) as this engine rank starts handling the first pull (``what="pull"``) or
    announcement (``"announce"``) from ``sender``, on the thread that handles it (the channel's dispatcher)."""
    engine = st.sides[key].engine
    owner, name = (engine._producer, "on_pull") if what == "pull" else (engine._consumer, "on_announce")
    handle, seen = getattr(owner, name), threading.Event()

    def noted(peer: str, body: Message) -> Any:
        if peer == sender and not seen.is_set():
            seen.set()
            st.notes.put(("handling", what, peer))
        return handle(peer, body)

    setattr(owner, name, noted)


def tamper(st: _State, key: str, tag: str, rid: str, layer: int | None = None, **changes: Any) -> None:
    """Fault hook: a peer that lies. The next message with tag ``tag`` (e.g. "ann", "pull", "push") for
    request ``rid`` (and ``layer``) goes out with ``changes`` applied to its fields; everything else,
    the data on the links included, stays as the engine made it."""
    engine = st.sides[key].engine
    send, request = engine._channel.send, engine._channel.request
    done = threading.Event()

    def forged(body: Message) -> Message:
        if (done.is_set() or type(body).__struct_config__.tag != tag or getattr(body, "request_id", None) != rid
                or (layer is not None and getattr(body, "layer", None) != layer)):
            return body
        done.set()
        return msgspec.structs.replace(body, **changes)

    def tampered_send(peer_id: str, body: Message, reply_to: int | None = None) -> int:
        return send(peer_id, forged(body), reply_to)

    def tampered_request(peer_id: str, body: Message, timeout_s: float | None = None, *,
                         at: str | None = None) -> Message:
        return request(peer_id, forged(body), timeout_s, at=at)

    engine._channel.send = tampered_send  # type: ignore[method-assign]
    engine._channel.request = tampered_request  # type: ignore[method-assign]


def recv_posted(st: _State, key: str, peer_id: str, count: int, timeout_s: float = 30.0) -> int:
    """Consumer: wait until ``count`` receives were posted on the link to ``peer_id`` (announcements accepted)."""
    peers = st.sides[key].engine._peers
    _poll(f"{count} receives posted from {peer_id}", timeout_s,
          lambda: peers.get(peer_id) is not None and peers.link(peer_id).stats().next_recv_seq >= count)
    return peers.link(peer_id).stats().next_recv_seq


def peer_gone(st: _State, key: str, peer_id: str, timeout_s: float = 30.0) -> float:
    """Wait until the channel declared ``peer_id`` lost and the engine dropped its link; return when."""
    engine = st.sides[key].engine
    return _poll(f"{peer_id} dropped", timeout_s,
                 lambda: not engine._channel.peer_alive(peer_id) and engine._peers.get(peer_id) is None)


def stats(st: _State, key: str) -> dict[str, Any]:
    engine = st.sides[key].engine
    out = asdict(engine.stats())
    out["channel"] = asdict(engine._channel.stats)
    out["staging_used"] = engine._consumer._stage.store.used_bytes
    out["staging_reserved"] = engine._consumer._stage.reserved_bytes
    out["links"] = {p.peer_id: p.link.result(0).stats().next_recv_seq
                    for p in engine._peers._peers.values() if p.link is not None and p.link.done()
                    and p.link.exception() is None}
    out["peers"] = sorted(engine._peers._peers)  # every peer this rank completed a handshake with
    return out


def links(st: _State, key: str) -> dict[str, Any]:
    """The data links an engine rank keeps (by id: the peer), and the link ids its live link threads serve."""
    engine = st.sides[key].engine
    kept = {link_id: peer.peer_id for link_id, peer in engine._peers._links.items()}
    threads = sorted({"kv-" + t.name.split("-")[3] for t in threading.enumerate()
                      if t.name.startswith("ncclkv-link-kv-")})
    return {"kept": kept, "threads": threads}


def logs(st: _State, contains: str = "") -> list[str]:
    return [line for line in st.logs if contains in line]


def close_all(st: _State) -> list[str]:
    """Close every engine rank of this process; return the ncclkv threads still alive (should be none)."""
    st.link_gate.set()  # a link held by hold_link ends its wait, so its opening thread can be joined
    for side in st.sides.values():
        side.engine.close()
    st.sides.clear()
    st.received.clear()
    st.sent.clear()
    st.logs.clear()
    return thread_names()


COMMANDS: dict[str, Callable[..., Any]] = {f.__name__: f for f in (
    build, hold, expect, wait, wait_layer, take_sent, push, start_push, stall, hold_link, release_link, note_handling,
    tamper, recv_posted, peer_gone, stats, links, logs, close_all,
)}


class _Capture(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self._lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self._lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def serve(conn: Connection, notes: Any, gate: Any) -> None:
    """The child's main loop; the engines it built are closed when it ends."""
    torch.set_num_threads(1)  # 2 shared cores, many processes
    state = _State(notes, gate)
    logging.getLogger("ncclkv").addHandler(_Capture(state.logs))
    conn.send(("ready", os.getpid()))
    try:
        for name, kwargs in commands(conn, IDLE_S):
            try:
                reply: tuple[str, Any] = ("ok", COMMANDS[name](state, **kwargs))
            except BaseException:  # noqa: BLE001 - shown by the test with the child's traceback
                reply = ("error", traceback.format_exc())
            conn.send(reply)
    finally:
        close_all(state)


# -- appended for tests/multiprocess/test_dead_peer_isolation.py ----------------------------------------------


def threads(st: _State, contains: str = "ncclkv") -> list[str]:
    """The names of this process's live threads that contain ``contains`` (e.g. an engine rank's task threads)."""
    return sorted(t.name for t in threading.enumerate() if contains in t.name)


COMMANDS[threads.__name__] = threads


# -- appended for tests/multiprocess/test_producer_restart_params.py ------------------------------------------


def incarnation(st: _State, key: str) -> int:
    """The engine rank's channel incarnation (the life of its peer id), as a worker puts it in its EngineRef."""
    return st.sides[key].engine._channel.incarnation


def wait_acked(st: _State, key: str, rid: str, timeout_s: float = 30.0) -> float:
    """Consumer: wait until every pull of ``rid`` with routes was acknowledged by its producer rank; return when."""
    consumer = st.sides[key].engine._consumer

    def acked() -> bool:
        with consumer._cond:
            req = consumer._requests.get(rid)
            return req is not None and req.unsent == 0
    return _poll(f"{rid}'s pulls acknowledged", timeout_s, acked)


def ensure(st: _State, key: str, peer_id: str, control_addr: str, incarnation: int = 0) -> tuple[str, str, float]:
    """Shake hands with ``peer_id`` at ``control_addr`` naming its life ``incarnation``, as a pull does (the
    engine's PeerLinks.ensure): ("ok", "", seconds) or (error type, message, seconds)."""
    started = time.monotonic()
    try:
        st.sides[key].engine._peers.ensure(peer_id, control_addr, True, incarnation)
    except Exception as err:  # noqa: BLE001 - the outcome under test
        return type(err).__name__, str(err), time.monotonic() - started
    return "ok", "", time.monotonic() - started


COMMANDS.update({f.__name__: f for f in (incarnation, wait_acked, ensure)})


def gate_users(st: _State, key: str, peer_id: str, count: int, timeout_s: float = 30.0) -> float:
    """Wait until ``count`` ensure() calls of the engine rank hold or await its handshake gate for ``peer_id``
    (e.g. that many pulls to it running, not queued); return when."""
    peers = st.sides[key].engine._peers

    def entered() -> bool:
        with peers._lock:
            gate = peers._connecting.get(peer_id)
            return gate is not None and gate.users >= count
    return _poll(f"{count} ensure() calls at the gate for {peer_id}", timeout_s, entered)


COMMANDS[gate_users.__name__] = gate_users
