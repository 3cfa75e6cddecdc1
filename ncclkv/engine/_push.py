"""Producer-side push: stream a request's layers to its consumer ranks as they are computed.

For each consumer rank with routes from us, a PushOffer reserves its staging
before any tensor is sent. ``save_layer`` returns at once: layers saved
before an offer is accepted wait in order in a backlog and are flushed, in
order, when it is; later layers go straight to the link. ``finish`` marks the
last layer; once every send completed each consumer rank gets ``Done``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial

import torch

from ..channel import Channel
from ..errors import ClosedError, NcclKVError, TransferError
from ..layout import KVGeometry, ParallelLayout, Route, Span, SpanSet, routes_from_rank
from ..paged import SlotMap
from ..protocol import MAX_EXTRA_KEYS, MAX_PUSH_TOKENS, MAX_TEXT_CHARS, Done, ErrorMsg, PushBlocks, PushOffer, RouteMsg
from ..transport import LinkBase
from ._caches import RankCaches, WireLease
from ._config import EngineRef, split_peer_id
from ._links import PeerLinks
from ._staging import BlockTokens
from ._stats import EngineStats
from ._tasks import fail_fast, submit_task

__all__ = ["BlockReads", "PushState", "Pusher", "SliceHooks", "tell"]

log = logging.getLogger("ncclkv.engine")


@dataclass(frozen=True, slots=True)
class SliceHooks:
    """What the link runs as it posts one piece: ``announce`` takes a wire buffer (from the caller's
    :class:`WireLease`), announces it and returns it (``Link.send``'s ``before_send``); ``gather`` fills it
    (``fill``)."""

    announce: Callable[[], torch.Tensor]
    gather: Callable[[torch.Tensor], None]


@dataclass(slots=True)
class BlockReads:
    """Whether a request's sends may still read its blocks (``TransferEngine.reclaim``): ``stopped``, the caller
    takes them back (a send not announced yet fails instead, nothing told of it); ``reused``, the caller writes
    them now (a send announced but not gathered yet fails too, which breaks its link: its tensor was described)."""

    stopped: bool = False
    reused: bool = False


# (link, consumer peer id, request id, layer, route, slots, token piece, lease, reads) -> the piece's hooks
Announcer = Callable[[LinkBase, str, str, int, Route, SlotMap, Span, WireLease, BlockReads], SliceHooks]


@dataclass(slots=True)
class PushState:
    request_id: str
    slots: SlotMap
    by_dst: dict[str, list[Route]]
    blocks: PushBlocks | None = None  # what the consumer's staging events name
    links: dict[str, LinkBase] = field(default_factory=dict)  # accepted consumer ranks
    errors: dict[str, BaseException] = field(default_factory=dict)
    saved: dict[int, torch.cuda.Event | None] = field(default_factory=dict)  # layer -> its ready event, in save order
    sends: dict[str, int] = field(default_factory=dict)  # sends queued per consumer rank
    open_sends: int = 0  # queued sends not completed yet, over every consumer rank
    failed: dict[str, BaseException] = field(default_factory=dict)  # first failed send per consumer rank
    unsaved: dict[str, BaseException] = field(default_factory=dict)  # consumer ranks whose layers finish() lacked
    nbytes: dict[str, int] = field(default_factory=dict)
    slices: dict[str, int] = field(default_factory=dict)  # (layer, route) slices sent per consumer rank: Done's count
    tail_sends: dict[str, int] = field(default_factory=dict)  # sends queued by the latest layer, per consumer rank
    reads: BlockReads = field(default_factory=BlockReads)  # reclaimed: its sends read the blocks no more
    finishing: bool = False
    completed: bool = False
    started: float = field(default_factory=time.monotonic)
    lock: threading.RLock = field(default_factory=threading.RLock)  # done-callbacks may run inline

    @property
    def resolved(self) -> bool:
        return len(self.links) + len(self.errors) == len(self.by_dst)


class Pusher:
    def __init__(self, rank: int, layout: ParallelLayout, geometry: KVGeometry, caches: RankCaches, channel: Channel,
                 peers: PeerLinks, executor: Executor, announcer: Announcer,
                 on_complete: Callable[[str, BaseException | None], None],
                 stats: EngineStats | None = None, piece_bytes: int = 0, last_piece_bytes: int = 0) -> None:
        self._rank, self._layout, self._geometry, self._caches = rank, layout, geometry, caches
        self._channel, self._peers, self._executor = channel, peers, executor
        self._announcer, self._on_complete = announcer, on_complete
        self._stats = stats
        self._piece_bytes = piece_bytes
        self._last_piece_bytes = last_piece_bytes
        self._lock = threading.Lock()
        self._pushes: dict[str, PushState] = {}

    def start(self, request_id: str, consumer: EngineRef, block_ids: list[int], num_tokens: int,
              blocks: BlockTokens | None = None) -> None:
        slots = self._caches.slot_map(block_ids, Span(0, num_tokens))
        if num_tokens > slots.num_tokens:
            raise ValueError(f"request {request_id!r}: {num_tokens} tokens do not fit {len(block_ids)} blocks")
        if blocks is not None and len(blocks.token_ids) != num_tokens // blocks.block_size * blocks.block_size:
            raise ValueError(f"request {request_id!r}: blocks name {len(blocks.token_ids)} tokens, the full "
                             f"blocks of {blocks.block_size} in {num_tokens} tokens hold "
                             f"{num_tokens // blocks.block_size * blocks.block_size}")
        by_dst: dict[str, list[Route]] = {}
        # Our routes of the plan the consumer checks this push's offer against, ours alone: the consumer's layout
        # comes from its reference (a client's kv_transfer_params), and the whole plan costs both layouts' ranks
        # times each other (4096 named ranks: seconds here, on the forward, and megabytes kept by the plan cache).
        tokens = SpanSet.range(0, num_tokens)
        for route in routes_from_rank(self._layout, consumer.layout, self._geometry, tokens, self._rank):
            by_dst.setdefault(consumer.peer_id(route.dst), []).append(route)
        state = PushState(request_id, slots, by_dst, _blocks_msg(request_id, blocks, self._channel.max_frame_bytes))
        with self._lock:
            if request_id in self._pushes:
                raise ValueError(f"request {request_id!r} is already being pushed")
            self._pushes[request_id] = state
        for dst, routes in by_dst.items():  # in dst's lane of the executor: never behind another consumer rank
            submit_task(self._executor, f"push of {request_id} to {dst}", partial(self._fail_dst, state, dst),
                        self._offer, state, consumer, dst, routes, num_tokens, peer=dst,
                        at=consumer.control_addrs[split_peer_id(dst)[1]])

    def pushing(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pushes

    def reads(self, request_id: str) -> BlockReads | None:
        """What says whether ``request_id``'s push may read its blocks; None when it is not being pushed."""
        with self._lock:
            state = self._pushes.get(request_id)
        return None if state is None else state.reads

    def save_layer(self, request_id: str, layer: int) -> None:
        state = self._state(request_id)
        with state.lock:
            if state.finishing:
                raise ValueError(f"request {request_id!r}: save_layer({layer}) after finish()")
            if layer in state.saved:  # its slices would go twice
                raise ValueError(f"request {request_id!r}: layer {layer} was already saved")
            # Recorded here, on the caller's stream: a backlog is sent later from another thread.
            ready = self._caches.ready_event()
            state.saved[layer] = ready
            for dst, link in list(state.links.items()):  # a failed send removes its consumer rank
                self._send_layer(state, dst, link, layer, ready)

    def finish(self, request_id: str) -> None:
        """No more layers: the sends still queued are posted from here, the rest completes on its own."""
        state = self._state(request_id)
        with state.lock:
            state.finishing = True
            for dst, routes in state.by_dst.items():  # a layer never saved would leave the consumer waiting
                missing = sorted({layer for r in routes for layer in r.layers} - state.saved.keys())
                if missing:
                    state.unsaved[dst] = TransferError(
                        f"push of {request_id!r}: finish() before layers {missing} were saved")
            tails = [(link, state.tail_sends.get(dst, 0)) for dst, link in state.links.items()]
        # Nothing computes behind the last layer's sends: the caller (the end of a forward) posts them, hooks
        # and gathers included, instead of returning and leaving them to each link's poster to be scheduled.
        for link, count in tails:
            if count:
                link.post_queued_sends(count)
        self._maybe_complete(state)

    # -- internals --------------------------------------------------------------------
    def _state(self, request_id: str) -> PushState:
        with self._lock:
            state = self._pushes.get(request_id)
        if state is None:
            raise ValueError(f"request {request_id!r} is not being pushed (call start_push first)")
        return state

    def _offer(self, state: PushState, consumer: EngineRef, dst: str, routes: list[Route], num_tokens: int) -> None:
        try:
            link = self._offer_once_more_on_reset(state, consumer, dst, routes, num_tokens)
            with state.lock:
                state.links[dst] = link
                for layer, ready in state.saved.items():  # the backlog, in save order
                    self._send_layer(state, dst, link, layer, ready)
        except Exception as err:  # this consumer rank fails (refused, or its backlog not queued); the others go on
            log.error("push of %s to %s refused or failed: %s: %s", state.request_id, dst, type(err).__name__, err,
                      exc_info=not isinstance(err, NcclKVError))  # a bug's traceback; a refusal is one line
            self._fail_dst(state, dst, err)
            # A consumer rank lost (or not answering): the offers queued behind this one for it (at that address)
            # fail now, instead of each shaking hands with it anew and waiting deadline_s.
            fail_fast(self._executor, dst, err, self._channel.peer_alive,
                      at=consumer.control_addrs[split_peer_id(dst)[1]])
            return
        self._maybe_complete(state)

    def _fail_dst(self, state: PushState, dst: str, error: BaseException) -> None:
        """Consumer rank ``dst`` of the push failed with ``error`` (kept if it already had one); the others go
        on, and the push completes once nothing else is open."""
        with state.lock:
            state.links.pop(dst, None)  # counted once, by its error (PushState.resolved); later layers skip it
            state.errors.setdefault(dst, error if isinstance(error, NcclKVError) else TransferError(
                f"push of {state.request_id!r} to {dst!r} failed: {type(error).__name__}: {error}"))
        self._maybe_complete(state)

    def _offer_once_more_on_reset(self, state: PushState, consumer: EngineRef, dst: str, routes: list[Route],
                                  num_tokens: int) -> LinkBase:
        """Shake hands with consumer rank ``dst`` if needed and offer it the push (once more under a new handshake
        after a reset: :meth:`PeerLinks.request`); the link the push goes on."""
        _, rank = split_peer_id(dst)
        nbytes = sum(r.nbytes(self._geometry) for r in routes)
        offer = PushOffer(state.request_id, self._rank, split_peer_id(self._channel.peer_id)[0],
                          tuple(RouteMsg.from_route(r) for r in routes), num_tokens, nbytes, state.blocks)
        self._peers.request(dst, consumer.control_addrs[rank], offer, True, f"push of {state.request_id}",
                            incarnation=consumer.incarnation(rank))
        return self._peers.link(dst)

    def _send_layer(self, state: PushState, dst: str, link: LinkBase, layer: int,
                    ready: torch.cuda.Event | None) -> None:
        """Under ``state.lock``: queue every route of ``layer`` for ``dst``, gathered after ``ready``.

        A link closed meanwhile (its peer lost, or broken) fails this consumer rank only; the
        caller's ``save_layer`` goes on for the others and never raises for it.
        """
        # A send that completed before its callback was added runs it here, on this thread (state.lock is
        # re-entrant): counted open until every route of this layer is queued, the push cannot complete
        # (and its blocks be handed back) while its later sends are not even queued.
        state.open_sends += 1
        try:
            self._queue_layer(state, dst, link, layer, ready)
        finally:
            state.open_sends -= 1

    def _queue_layer(self, state: PushState, dst: str, link: LinkBase, layer: int,
                     ready: torch.cuda.Event | None) -> None:
        queued = 0
        for route in state.by_dst[dst]:
            if layer not in route.layers or dst not in state.links:
                continue
            state.slices[dst] = state.slices.get(dst, 0) + 1
            for piece in route.pieces(self._geometry, self._piece_size(layer, route)):
                # Queued as a placeholder: the hook takes the buffer when the link posts it, so a backlog of
                # saved layers holds no memory beyond the link's window.
                placeholder, lease = self._caches.placeholder(piece, route.heads), self._caches.lease()
                hooks = self._announcer(link, dst, state.request_id, layer, route, state.slots, piece, lease,
                                        state.reads)
                try:
                    future = link.send(placeholder, before_send=hooks.announce, fill=hooks.gather, ready_event=ready)
                except ClosedError as err:
                    log.warning("push of %s to %s: layer %d not sent: %s", state.request_id, dst, layer, err)
                    del state.links[dst]
                    state.errors[dst] = TransferError(
                        f"push of {state.request_id!r} to {dst!r}: layer {layer} not sent: {err}")
                    return
                state.sends[dst] = state.sends.get(dst, 0) + 1
                state.open_sends += 1
                queued += 1
                state.nbytes[dst] = state.nbytes.get(dst, 0) + placeholder.nbytes
                future.add_done_callback(lease.end)
                future.add_done_callback(lambda f, dst=dst: self._sent(state, dst, f))
        if queued:
            state.tail_sends[dst] = queued

    def _piece_size(self, layer: int, route: Route) -> int:
        """Token pieces of at most this many bytes per layer (0: whole): ``last_piece_bytes`` for the route's last
        layer, the one whose gather, wire and scatter are left after the forward; ``piece_bytes`` before it."""
        size, last = self._piece_bytes, self._last_piece_bytes
        if layer == route.layers.stop - 1 and last and (not size or last < size):
            return last
        return size

    def _sent(self, state: PushState, dst: str, future: Future[None]) -> None:
        """A send completed: count it (a count, not a scan of every send, per completion)."""
        with state.lock:
            state.open_sends -= 1
            error = future.exception()
            if error is not None:
                state.failed.setdefault(dst, error)
        self._maybe_complete(state)

    def _maybe_complete(self, state: PushState) -> None:
        with state.lock:
            if state.completed or not state.finishing or not state.resolved or state.open_sends:
                return
            state.completed = True
            outcome = {dst: state.errors.get(dst) or state.failed.get(dst) or state.unsaved.get(dst)
                       for dst in state.by_dst}
        with self._lock:
            self._pushes.pop(state.request_id, None)
        first_error = next((error for error in outcome.values() if error is not None), None)
        if first_error is not None and not isinstance(first_error, NcclKVError):
            first_error = TransferError(str(first_error))
        try:
            for dst, error in outcome.items():
                if error is None:
                    if self._stats is not None:
                        self._stats.record_send(state.nbytes.get(dst, 0), state.sends.get(dst, 0),
                                                time.monotonic() - state.started)
                    tell(self._channel, dst, Done(state.request_id, state.slices.get(dst, 0), state.nbytes.get(dst, 0)))
                else:
                    tell(self._channel, dst, ErrorMsg.from_exception(error, state.request_id))
        finally:  # reported exactly once (``completed``), whatever telling the consumers did
            self._on_complete(state.request_id, first_error)


def tell(channel: Channel, peer: str, body: Done | ErrorMsg) -> None:
    """Send ``body`` to ``peer``, best effort: a peer that is gone reports the request on its own side."""
    try:
        channel.send(peer, body)
    except Exception as err:  # a closed channel (this engine closes) is no news
        log.log(logging.DEBUG if isinstance(err, ClosedError) else logging.WARNING, "could not tell %s about %s: %s",
                peer, body.request_id, err)


def _blocks_msg(request_id: str, blocks: BlockTokens | None, max_frame_bytes: int) -> PushBlocks | None:
    """``blocks`` for the offer, or None (the push goes on, unreported) when they would not fit it:
    at most half a frame, so the routes always have room."""
    if blocks is None or not blocks.token_ids:
        return None
    keys = blocks.extra_keys
    size = 9 * (len(blocks.token_ids) + len(keys)) + sum(len(k.encode()) for k in keys if isinstance(k, str))
    if (len(blocks.token_ids) > MAX_PUSH_TOKENS or len(keys) > MAX_EXTRA_KEYS or size > max_frame_bytes // 2
            or any(isinstance(k, str) and len(k) > MAX_TEXT_CHARS for k in keys)
            or any(isinstance(k, int) and not -(2**63) <= k < 2**63 for k in keys)):
        log.info("push of %s: its %d blocks are too large to name in the offer; no staging events for it",
                 request_id, blocks.num_blocks)
        return None
    return PushBlocks(blocks.token_ids, blocks.block_size, keys)
