"""The producer side of one rank: requests held for pulling, and serving the pulls.

A finished request's blocks are held until every consumer rank has pulled
(each consumer rank sends one PullRequest to every producer rank, with no
routes where the plan gives it nothing from us), or until ``hold_s`` passes.
Tensors go out layer-major so a consumer can finish layer 0 first; each
tensor is announced, then gathered, on the thread that posts it right before
it is posted, so announcement order is data order on that link (and the
consumer posts its receive during the gather). With ``piece_bytes``
a (layer, route) slice goes as several token pieces, each announced alone, so
gather, wire and scatter of one slice overlap (the last layer's latency).
A pull sends a route's small slices of consecutive layers together, one
tensor per run of at most ``pull_batch_bytes``: a tensor's fixed costs (its
announcement, frame header and thread hand-offs) then come once per run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial

import torch

from .._affinity import pinned
from ..channel import Channel
from ..errors import (CapacityError, PeerLostError, PeerResetError, ProtocolError, ShapeMismatchError, TransferError,
                      TransferTimeout)
from ..layout import KVGeometry, ParallelLayout, Route, Span, SpanSet, routes_between
from ..paged import SlotMap
from ..protocol import MAX_TEXT_CHARS, Ack, Announce, Done, ErrorCode, ErrorMsg, PullRequest, RouteMsg
from ..transport import LinkBase
from ._caches import RankCaches, WireLease
from ._config import EngineRef, holds_differ, peer_id
from ._links import Peer, PeerLinks
from ._offers import routes_text
from ._push import BlockReads, Pusher, SliceHooks, tell
from ._recent import RecentEnds
from ._staging import BlockTokens
from ._stats import EngineStats

__all__ = ["MAX_ENDED_HOLDS", "MAX_PARKED_PULLS", "MAX_PARKED_PULLS_PER_PEER", "ProducerSide"]

# Pulls for requests this rank does not hold yet (the decode request came before the prefill finished) wait
# up to deadline_s each; at most this many at once, in all and per peer: any peer could otherwise park
# pulls for made-up request ids as fast as it can send them (40,000 in 1.7 s, 128 MiB), or crowd out others.
MAX_PARKED_PULLS = 4096
MAX_PARKED_PULLS_PER_PEER = 1024
# Held requests reported (served, released, expired, failed) and remembered for hold_s, at most this many (the
# oldest forgotten first): a pull for one is answered at once with why it ended, instead of being parked, where
# it waited deadline_s for nothing, or was served by the next hold of the id as if it were that one's consumer.
MAX_ENDED_HOLDS = 4096
_MAX_REASON_CHARS = 1024  # of an ended hold's reason kept (bounds what MAX_ENDED_HOLDS entries hold)

log = logging.getLogger("ncclkv.engine")


@dataclass(slots=True)
class _Held:
    request_id: str
    slots: SlotMap
    num_tokens: int
    deadline: float
    expected: set[str] | None = None  # consumer peer ids that will pull; known at the first pull
    served: set[str] = field(default_factory=set)
    error: BaseException | None = None
    serving: int = 0  # pulls whose sends from these blocks are still running
    released: bool = False  # no new pulls; reported once ``serving`` is 0
    ready: torch.cuda.Event | None = None  # CUDA: recorded by finish() on the caller's stream; gathers wait for it
    hold: int = 0  # which hold of the id this is (finish(..., hold=)); 0: not named
    reads: BlockReads = field(default_factory=BlockReads)  # reclaimed: its sends read the blocks no more


class ProducerSide:
    def __init__(self, rank: int, layout: ParallelLayout, geometry: KVGeometry, caches: RankCaches,
                 channel: Channel, peers: PeerLinks, executor: Executor, stats: EngineStats, hold_s: float,
                 deadline_s: float, piece_bytes: int = 0, last_piece_bytes: int = 0, pull_batch_bytes: int = 0,
                 cpus: frozenset[int] | None = None) -> None:
        self._rank, self._layout, self._geometry = rank, layout, geometry
        self._cpus = cpus  # where a push's last sends are posted from (EngineConfig.cpus)
        self._piece_bytes = piece_bytes  # each (layer, route) slice in pieces of at most this (0: whole)
        self._pull_batch_bytes = pull_batch_bytes  # a pull's runs of small layers in one tensor of at most this
        self._caches, self._channel, self._peers, self._stats = caches, channel, peers, stats
        self._hold_s, self._deadline_s = hold_s, deadline_s
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._early: dict[str, list[tuple[str, PullRequest, float]]] = {}  # pulls before finish()
        self._parked_by: dict[str, int] = {}  # sender -> its pulls in _early (MAX_PARKED_PULLS)
        self._finished: dict[str, BaseException | None] = {}
        # Held requests reported since at most hold_s, by id: (its hold number, why it ended).
        self._ended: RecentEnds[tuple[int, str]] = RecentEnds(hold_s, MAX_ENDED_HOLDS)
        self._pusher = Pusher(rank, layout, geometry, caches, channel, peers, executor, self._announcer,
                              self._pushed, stats, piece_bytes, last_piece_bytes)

    def start_push(self, request_id: str, consumer: EngineRef, block_ids: Sequence[int], num_tokens: int,
                   blocks: BlockTokens | None = None) -> None:
        self._pusher.start(request_id, consumer, list(block_ids), num_tokens, blocks)

    def save_layer(self, request_id: str, layer: int) -> None:
        if layer not in self._caches.shard.layers:
            raise ValueError(f"layer {layer} is not on this rank (layers {self._caches.shard.layers!r})")
        self._pusher.save_layer(request_id, layer)

    def finish(self, request_id: str, block_ids: Sequence[int] | None = None, num_tokens: int | None = None,
               hold: int = 0) -> None:
        """End a pushed request (no more layers), or hold a request's blocks for the consumers to pull (``hold``:
        this hold's number, which the consumers' pulls and declines name; 0: not named)."""
        if self._pusher.pushing(request_id):
            if hold:
                raise ValueError(f"request {request_id!r} is being pushed: hold={hold} names a hold for pulling")
            with pinned(self._cpus):  # its last sends are posted, gathers included, on this thread
                self._pusher.finish(request_id)
            return
        if block_ids is None or num_tokens is None:
            raise ValueError(f"request {request_id!r} is not being pushed: finish() needs block_ids and num_tokens")
        slots = self._caches.slot_map(block_ids, Span(0, num_tokens))
        if num_tokens > slots.num_tokens:
            raise ValueError(f"request {request_id!r}: {num_tokens} tokens do not fit {len(block_ids)} blocks")
        with self._lock:
            if request_id in self._held:
                raise ValueError(f"request {request_id!r} is already held for pulling")
            self._ended.pop(request_id)  # held anew: pulls for it are this hold's
            self._held[request_id] = _Held(request_id, slots, num_tokens, self._channel.clock.now() + self._hold_s,
                                           ready=self._caches.ready_event(), hold=hold)
            early = self._early.pop(request_id, [])
            self._unpark_locked(early)
        for sender, pull, _ in early:
            other = _other_hold(pull, hold)
            if other is None:
                self._serve_or_refuse(sender, pull)
            elif pull.routes:  # parked for another hold of the id: refused, as it would be now (on_pull)
                log.info("refused parked pull %s from %s: %s", request_id, sender, other)
                tell(self._channel, sender, ErrorMsg(request_id, ErrorCode.UNKNOWN_REQUEST, other[:MAX_TEXT_CHARS],
                                                     pull.hold))
            else:  # a decline for another hold, acknowledged when it was parked: it counts for nothing
                log.info("parked decline of %s from %s counts for nothing: %s", request_id, sender, other)

    def on_pull(self, sender: str, pull: PullRequest) -> Ack | ErrorMsg:
        """Dispatcher thread: check the pull against our own plan, then serve it, or park it when the request is
        not held yet. A pull for a request whose hold ended here (reported within ``hold_s``), or for another
        hold of the id than the one held (both named), is answered at once with why (``unknown_request``); a
        pull of nothing for it (a decline) is acknowledged and counts for nothing."""
        routes = self._check_pull(sender, pull)
        if routes:
            self._drop_closed_link(sender, pull)
        with self._lock:
            held = self._held.get(pull.request_id)
            ended = self._ended_reason_locked(pull.request_id, held, pull.hold)
            if ended is None and held is not None and not held.released:
                ended = _other_hold(pull, held.hold)
            if ended is not None:
                if not pull.routes:
                    log.info("decline of %s from %s counts for nothing: %s", pull.request_id, sender, ended)
                    return Ack(pull.request_id, None)
                log.info("refused pull %s from %s: %s", pull.request_id, sender, ended)
                return ErrorMsg(pull.request_id, ErrorCode.UNKNOWN_REQUEST, ended[:MAX_TEXT_CHARS], pull.hold)
            # Not held yet; or released, not yet reported, and the pull is for another hold (one to come): it
            # waits for that hold, as it would once this one is reported (_ended_reason_locked).
            if held is None or held.released:
                self._check_room_to_park(sender, pull.request_id)
                parked = (sender, pull, self._channel.clock.now() + self._deadline_s)
                self._early.setdefault(pull.request_id, []).append(parked)
                self._parked_by[sender] = self._parked_by.get(sender, 0) + 1
                return Ack(pull.request_id, None)
        self._serve(sender, pull, held, routes)
        return Ack(pull.request_id, None)

    def take_finished(self) -> dict[str, BaseException | None]:
        """Requests whose blocks may be freed now: served to every consumer, failed, or expired."""
        now = self._channel.clock.now()  # hold times leave out pauses of this process (ncclkv._clock)
        refused: list[tuple[str, PullRequest]] = []
        with self._lock:
            for request_id, held in list(self._held.items()):
                if held.serving:  # sends still read its blocks: never report it yet
                    continue
                if held.expected is not None and held.served >= held.expected:
                    self._finished[request_id] = held.error
                    why = (f"it was pulled by every consumer rank ({', '.join(sorted(held.served))})"
                           if held.error is None else _ended_with(held.error))
                elif now > held.deadline:
                    # Never asked for at all: most often a consumer that expects it pushed (the two engines set
                    # up for different modes), or one that never expected it.
                    unasked = "" if held.served or held.expected is not None else (
                        ": no consumer rank asked for it (one that expects it pushed waits for a start_push that "
                        "never came)")
                    expired = TransferTimeout(
                        f"request {request_id!r} was released after hold_s={self._hold_s:g}s; pulled by "
                        f"{sorted(held.served)} of "
                        f"{sorted(held.expected) if held.expected is not None else 'unknown consumers'}{unasked}"
                    )
                    self._finished[request_id] = held.error or expired
                    why = str(expired) if held.error is None else _ended_with(held.error)
                else:
                    continue
                del self._held[request_id]
                self._ended.note(request_id, now, (held.hold, why[:_MAX_REASON_CHARS]))
            self._ended.expire(now)  # remembered hold_s: a pull later than that may be for a hold to come
            for request_id, parked in list(self._early.items()):
                keep = [p for p in parked if p[2] >= now]
                expired = [p for p in parked if p[2] < now]
                self._unpark_locked(expired)
                refused += [(s, p) for s, p, _ in expired]
                if keep:
                    self._early[request_id] = keep
                else:
                    del self._early[request_id]
            done, self._finished = self._finished, {}
        for sender, pull in refused:
            self._send_error(sender, TransferTimeout(
                f"request {pull.request_id!r} was not held by producer rank {self._channel.peer_id!r} within "
                f"deadline_s={self._deadline_s:g}s of its pull (never held here: its prefill has not finished, or "
                f"the id is unknown)"), pull)
        return done

    def release(self, request_id: str) -> bool:
        """Stop holding ``request_id`` for pulls; :meth:`take_finished` reports it (with an error) once no
        send from its blocks is running. False when it is not held."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                return False
            self._release_locked(held, "released")
            return True

    def _release_locked(self, held: _Held, how: str) -> None:
        held.released = True
        held.deadline = float("-inf")
        held.error = held.error or TransferError(
            f"request {held.request_id!r} was {how} by its producer before every consumer rank pulled (pulled by "
            f"{sorted(held.served)})")

    def reclaim(self, request_id: str, reused: bool = False) -> bool:
        """The caller takes ``request_id``'s blocks back (see :meth:`TransferEngine.reclaim`): a hold is released,
        and the sends of its pulls and of its push not announced yet read them no more (``reused``: nor those
        announced and not gathered yet). False when it is neither held nor pushed."""
        with self._lock:
            held = self._held.get(request_id)
            if held is not None:
                self._release_locked(held, "reclaimed")
        reads = [r for r in (None if held is None else held.reads, self._pusher.reads(request_id)) if r is not None]
        for each in reads:  # plain stores, read by the link's send thread at each announce and gather
            each.stopped = True
            each.reused = each.reused or reused
        return bool(reads)

    def peer_lost(self, peer_id: str, error: PeerLostError) -> None:
        """Dispatcher thread: consumer rank ``peer_id`` is lost (gone, restarted, or it dropped us): its parked
        pulls go, unanswered, and a held request it was to pull and has not is released with an error (its
        consumer engine can no longer complete it), instead of holding its blocks ``hold_s``. Pulls that come
        after (the dispatcher handles them after this) are the peer's anew."""
        with self._lock:
            for request_id, parked in list(self._early.items()):
                mine = [entry for entry in parked if entry[0] == peer_id]
                if not mine:
                    continue
                self._unpark_locked(mine)
                rest = [entry for entry in parked if entry[0] != peer_id]
                if rest:
                    self._early[request_id] = rest
                else:
                    del self._early[request_id]
            for request_id, held in self._held.items():
                if held.released or held.expected is None or peer_id not in held.expected or peer_id in held.served:
                    continue
                held.released = True
                held.deadline = float("-inf")
                held.error = held.error or TransferError(
                    f"request {request_id!r}: its consumer rank {peer_id!r} was lost before it pulled: {error}")
                log.info("released %s: consumer %s lost before it pulled", request_id, peer_id)

    def _pushed(self, request_id: str, error: BaseException | None) -> None:
        with self._lock:
            self._finished[request_id] = error

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held) + len(self._early)

    # -- internals --------------------------------------------------------------------
    def _ended_reason_locked(self, request_id: str, held: _Held | None, hold: int) -> str | None:
        """Why a pull for hold ``hold`` of ``request_id`` cannot be served here, when that hold ended (reported
        within ``hold_s``, or released and about to be); None when it is held, or never was (a pull may come
        before the hold), or the hold that ended is another one (both named). Lock held."""
        if held is not None:
            if not held.released or holds_differ(hold, held.hold):
                return None
            return (f"request {request_id!r} is no longer held by producer rank {self._channel.peer_id!r}: "
                    f"{_ended_with(held.error) if held.error is not None else 'it was released'}")
        now = self._channel.clock.now()
        ended = self._ended.get(request_id, now)  # past hold_s: a pull now may be for a hold to come
        if ended is None:
            return None
        since, (ended_hold, why) = ended
        if holds_differ(hold, ended_hold):  # the pull is for a hold to come (another number): parked for it
            return None
        age = now - since
        return (f"request {request_id!r} is no longer held by producer rank {self._channel.peer_id!r}: its hold "
                f"ended {max(0.0, age):.3g}s ago: {why}")

    def _check_room_to_park(self, sender: str, request_id: str) -> None:
        """CapacityError (the peer is answered ``capacity``) when parking one more pull passes
        MAX_PARKED_PULLS_PER_PEER for ``sender`` or MAX_PARKED_PULLS in all. Lock held."""
        mine, everyone = self._parked_by.get(sender, 0), sum(self._parked_by.values())
        if mine >= MAX_PARKED_PULLS_PER_PEER or everyone >= MAX_PARKED_PULLS:
            raise CapacityError(f"pull for {request_id!r} from {sender!r}: the request is not held here and "
                                f"{everyone} pulls already wait for theirs, {mine} of them {sender!r}'s (at most "
                                f"{MAX_PARKED_PULLS}, {MAX_PARKED_PULLS_PER_PEER} a peer)")

    def _unpark_locked(self, entries: Sequence[tuple[str, PullRequest, float]]) -> None:
        for sender, _, _ in entries:
            left = self._parked_by[sender] - 1
            if left:
                self._parked_by[sender] = left
            else:
                del self._parked_by[sender]

    def _check_pull(self, sender: str, pull: PullRequest) -> list[Route]:
        peer = self._peers.known(sender)
        if peer is None:  # answered peer_reset: the consumer shakes hands again and asks once more
            raise PeerResetError(f"pull for {pull.request_id!r} from {sender!r} before any handshake (none held "
                                 f"here: it was lost, or this process restarted)")
        if pull.dst_rank != peer.remote.rank or pull.consumer_engine_id != peer.remote.engine_id:
            raise ProtocolError(f"pull from {sender!r} names engine {pull.consumer_engine_id!r} rank {pull.dst_rank}")
        routes = [Route(m.src, m.dst, *m.spans()) for m in pull.routes]
        if routes:
            # Our plan of this one link: the whole plan's work is every consumer rank's boxes times the pull's
            # spans (a peer declaring 4096 ranks and pulling 4096 one-token spans: 16.7 M routes), and not cached.
            tokens = SpanSet(r.tokens for r in routes)
            mine = list(routes_between(self._layout, peer.remote.layout.to_layout(), self._geometry, tokens,
                                       self._rank, pull.dst_rank))
            if sorted(routes) != sorted(mine):
                raise ProtocolError(
                    f"pull for {pull.request_id!r} from {sender!r} asks routes {routes_text(routes, mine)} but our "
                    f"plan gives {routes_text(mine, routes)}"
                )
        return routes

    def _drop_closed_link(self, sender: str, pull: PullRequest) -> None:
        """A pull is served on the link of our handshake with ``sender``: one that link can no longer carry (it
        broke: a send of ours failed after its announcement, as reclaim(reused=True) does) is dropped here, and the
        pull answered ``peer_reset`` (:class:`PeerResetError`): the consumer shakes hands again, on a new link, and
        asks once more. The consumer's end of that link may look sound still (it learns of the break only when a
        receive on it fails), and its request may have failed first by our error: its next pull would otherwise
        go under that handshake and fail with ClosedError, needlessly."""
        peer = self._peers.get(sender)
        if peer is None or peer.link is None or not peer.link.done() or peer.link.cancelled() \
                or peer.link.exception() is not None:  # none, or not open: served or failed as before
            return
        link = peer.link.result()
        if not link.closed:
            return
        why = f"broken: {link.broken}" if link.broken is not None else "closed"
        self._peers.forget(peer, f"its link {link.link_id!r} is {why}")
        raise PeerResetError(f"pull for {pull.request_id!r} from {sender!r}: our link {link.link_id!r} to it is "
                             f"{why}; its handshake is dropped here (shake hands again, for a new link)")

    def _serve_or_refuse(self, sender: str, pull: PullRequest) -> None:
        try:
            routes = self._check_pull(sender, pull)
            with self._lock:
                held = self._held[pull.request_id]
            self._serve(sender, pull, held, routes)
        except Exception as err:  # reported to the consumer; never silent
            log.error("cannot serve pull %s from %s: %s", pull.request_id, sender, err)
            self._send_error(sender, err, pull)

    def _serve(self, sender: str, pull: PullRequest, held: _Held, routes: list[Route]) -> None:
        peer = self._peers.get(sender)
        assert peer is not None
        consumer_layout = peer.remote.layout.to_layout()
        asked = max((r.tokens.stop for r in routes), default=0)
        if asked > held.num_tokens:
            raise ShapeMismatchError(f"pull for {pull.request_id!r} asks tokens up to {asked}, beyond the "
                                     f"{held.num_tokens} held")
        with self._lock:
            # Checked and counted at once: once released (or reported), its blocks may be reused.
            if self._held.get(pull.request_id) is not held or held.released:
                raise TransferError(f"request {pull.request_id!r} was released by the producer")
            if held.expected is None:
                held.expected = {peer_id(pull.consumer_engine_id, r) for r in range(consumer_layout.world_size)}
            held.serving += int(bool(routes))  # released by _mark_served(..., sending=True) once every send ended
        if not routes:
            self._mark_served(held, sender, None)
            return
        # Here on the dispatcher the link may still be opening (a consumer pulling under a handshake we started,
        # for a push, or both sides starting one at once): its sends are queued once it opens, never waited for
        # here, where every other peer's messages would wait behind this one's link (PeerLinks.when_open).
        since = self._channel.clock.now()
        self._peers.when_open(peer, partial(self._serve_on_open, sender, pull, held, routes, since, peer))

    def _serve_on_open(self, sender: str, pull: PullRequest, held: _Held, routes: list[Route], since: float,
                       waited: Peer, _: LinkBase | None, error: BaseException | None) -> None:
        """Queue a pull's sends once its link is open (on the dispatcher if it already was, else on the thread that
        opened it); ``error``: it never will be. Done, or ErrorMsg, goes once every send ended."""
        current = self._peers.get(sender)
        if error is None and current is not None and current is not waited and current.link is not None \
                and not current.link.done():  # a newer handshake took over meanwhile: its link is the one to send on
            self._peers.when_open(current, partial(self._serve_on_open, sender, pull, held, routes, since, current))
            return
        if error is None and self._channel.clock.now() - since > self._deadline_s:  # the deadline of the old wait
            error = TransferTimeout(f"link to {sender!r} not open after {self._deadline_s}s")
        futures: list[Future[None]] = []
        errors: list[BaseException] = []
        nbytes = 0
        slices = sum(len(route.layers) for route in routes)  # (layer, route) slices: what Done counts
        started = time.monotonic()
        try:
            if error is not None:
                raise error  # nothing is queued: the consumer is told below
            link = self._peers.link(sender)  # the current link, open: it returns at once
            for layers, route, piece in self._pull_sends(routes):
                placeholder = self._caches.placeholder(piece, route.heads, len(layers))
                lease = self._caches.lease()
                nbytes += placeholder.nbytes  # a placeholder: see Pusher._queue_layer
                hooks = self._announcer(link, sender, pull.request_id, layers.start, route, held.slots, piece, lease,
                                        held.reads, len(layers), pull.hold)
                futures.append(link.send(placeholder, before_send=hooks.announce, fill=hooks.gather,
                                         ready_event=held.ready))
                futures[-1].add_done_callback(lease.end)
        except Exception as err:  # the link closed or broke while queueing: the sends queued still end
            errors.append(err)
        remaining = [len(futures)]
        gate = threading.Lock()

        def end() -> None:
            error = errors[0] if errors else None
            try:
                if error is None:
                    self._stats.record_send(nbytes, len(futures), time.monotonic() - started)
                    tell(self._channel, sender, Done(pull.request_id, slices, nbytes, pull.hold))
                else:
                    self._send_error(sender, error, pull)
            except Exception as err:  # noqa: BLE001 - on a send's done-callback, where it would only be logged
                log.error("pull %s from %s: ending its sends failed: %s: %s", pull.request_id, sender,
                          type(err).__name__, err, exc_info=err)
                error = error or TransferError(f"pull {pull.request_id!r} from {sender!r}: ending its sends failed: "
                                               f"{type(err).__name__}: {err}")
            # Always: else ``serving`` never drops and take_finished() never reports the request (its blocks held).
            self._mark_served(held, sender, error, sending=True)

        def on_sent(future: Future[None]) -> None:
            with gate:
                if future.exception() is not None:
                    errors.append(future.exception())
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                end()

        if not futures:
            end()
        for future in futures:
            future.add_done_callback(on_sent)

    def _pull_sends(self, routes: Sequence[Route]) -> list[tuple[Span, Route, Span]]:
        """A pull's sends in the order they go out, each (layers, route, tokens): layer-major, so a consumer can
        finish layer 0 first. A route's slices cut into pieces go one piece of one layer each; the others as
        runs of consecutive layers of at most ``pull_batch_bytes`` (and ``piece_bytes``, when set) in all (one
        tensor, one announcement)."""
        sends = []
        # piece_bytes, when set, bounds every tensor: a run of whole small slices too
        batch = min(self._pull_batch_bytes, self._piece_bytes) if self._piece_bytes else self._pull_batch_bytes
        for route in routes:
            pieces = route.pieces(self._geometry, self._piece_bytes)
            if len(pieces) == 1:
                runs = route.layer_runs(self._geometry, batch)
                sends.extend((run, route, pieces[0]) for run in runs)
            else:
                sends.extend((Span(layer, layer + 1), route, piece) for layer in route.layers for piece in pieces)
        sends.sort(key=lambda send: send[0].start)  # stable: routes, then pieces, in order within a layer
        return sends

    def _announcer(self, link: LinkBase, sender: str, request_id: str, layer: int, route: Route, slots: SlotMap,
                   piece: Span, lease: WireLease, reads: BlockReads, num_layers: int = 1, hold: int = 0) -> SliceHooks:
        """The hook and the fill of one piece's send: announce, then gather (see ``Link.send``); ``num_layers``
        > 1: the slices of that many layers from ``layer`` on, stacked in one tensor; ``hold``: the number of
        the hold the pull named, in its announcement. ``reads``: once the request is reclaimed, the announce
        fails (nothing is told of the tensor); once its blocks are reused, the gather fails too.

        The Announce goes out before the gather, so the consumer's receive is
        posted while the bytes are gathered, not a control round trip after.
        """
        piece_msg = None if piece == route.tokens else (piece.start, piece.stop)

        def take_and_announce() -> torch.Tensor:  # on the link's send thread, in send order, as it posts
            if reads.stopped:
                raise TransferError(f"request {request_id!r} was reclaimed by its producer (its blocks are to be "
                                    f"reused): layer {layer} not sent to {sender!r}")
            peer = self._peers.kept(link.link_id)  # the link's counter is on its handshake (Peer.sent_seq)
            if peer is None:  # dropped meanwhile (closed: this send would fail at its post anyway)
                raise PeerLostError(f"link {link.link_id!r} to {sender!r} was dropped before {request_id!r} layer "
                                    f"{layer} was announced on it")
            buf = lease.take(piece, route.heads, num_layers)
            seq = peer.sent_seq
            self._channel.send(sender, Announce(
                request_id, layer, RouteMsg.from_route(route), tuple(buf.shape), self._geometry.dtype,
                buf.numel() * buf.element_size(), seq, link.link_id, piece_msg, num_layers, hold,
            ))
            peer.sent_seq = seq + 1  # only once announced: a send that failed leaves no gap
            return buf

        def gather(buf: torch.Tensor) -> None:
            if num_layers == 1:
                self._caches.gather(layer, slots, piece, route.heads, buf)
            else:
                for i in range(num_layers):  # each layer's slice is a contiguous part of the stack
                    self._caches.gather(layer + i, slots, piece, route.heads, buf[i])
            # Reused before or while it gathered (the caller writes them once reclaim(reused=True) returns): what it
            # read may be the next request's, and the consumer waits for these bytes (announced). Seen unset here,
            # the copy ended before that call did.
            if reads.reused:
                raise TransferError(f"request {request_id!r}: its blocks were reused before layers {layer} to "
                                    f"{layer + num_layers - 1} were gathered for {sender!r}")
        return SliceHooks(take_and_announce, gather)

    def _mark_served(self, held: _Held, sender: str, error: BaseException | None, sending: bool = False) -> None:
        with self._lock:
            held.serving -= int(sending)
            held.served.add(sender)
            if error is not None and held.error is None:
                held.error = error

    def _send_error(self, sender: str, error: BaseException, pull: PullRequest) -> None:
        """Tell ``sender`` that ``pull`` failed, naming its hold (a late answer is then told from the next hold's)."""
        tell(self._channel, sender, ErrorMsg.from_exception(error, pull.request_id, pull.hold))


def _other_hold(pull: PullRequest, hold: int) -> str | None:
    """Why ``pull`` is not for hold number ``hold`` of its request id held here; None when it may be."""
    if not holds_differ(pull.hold, hold):
        return None
    what = "pull" if pull.routes else "decline"
    return (f"request {pull.request_id!r} is held here as hold {hold}, the {what} is for hold {pull.hold} (an "
            f"earlier or later hold of the id)")


def _ended_with(error: BaseException) -> str:
    """Why a hold ended, from the error it was reported with."""
    return f"it ended with {type(error).__name__}: {error}"
