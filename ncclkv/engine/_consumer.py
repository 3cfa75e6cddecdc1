"""The consumer side of one rank: expected requests, announcements, landing tensors layer by layer.

``expect`` plans which producer ranks send what to this rank and asks each
producer rank (all of them: those with nothing for us learn they can release
their blocks). Each announcement is checked against the plan before its
receive is posted, in announcement order, so receives match sends on the
link. A tensor that cannot be accepted but is plausibly sized is received
into scratch and dropped (the link stays in step); an implausible one breaks
the link. A request fails alone: its blocks are reported, never half-filled
silently.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future
from functools import partial

import torch

from .._affinity import pinned
from .._peers import lost_there
from ..channel import Channel
from ..errors import (CapacityError, ClosedError, HandshakeError, NcclKVError, PeerLostError, PeerResetError,
                      ProtocolError, ShapeMismatchError, TransferError, TransferTimeout)
from ..layout import DTYPE_SIZES, KVGeometry, ParallelLayout, Route, Span, SpanSet, cached_plan, pp_layer_spans
from ..protocol import Ack, Announce, Done, ErrorMsg, PullRequest, PushOffer, RouteMsg
from ..transport import LinkBase
from ._caches import RankCaches, torch_dtype
from ._config import EngineRef, holds_differ, peer_id, split_peer_id
from ._links import Peer, PeerLinks
from ._push_stage import PushStage, SliceKey, StagedPush, StagedTensor
from ._staging import StagingEvent
from ._stats import EngineStats
from ._declines import Decliner
from ._ended import EndedTransfers
from ._expected import Expected, add_piece, as_ncclkv, awaits, covers_slice, layers_text, overlaps
from ._offers import check_offer, refused_offer
from ._tasks import fail_fast, submit_task

__all__ = ["ConsumerSide"]

log = logging.getLogger("ncclkv.engine")



class ConsumerSide:
    def __init__(self, engine_id: str, rank: int, layout: ParallelLayout, geometry: KVGeometry, caches: RankCaches,
                 channel: Channel, peers: PeerLinks, executor: Executor, stats: EngineStats, deadline_s: float,
                 staging_bytes: int, hold_s: float, cpus: frozenset[int] | None = None) -> None:
        self._engine_id, self._rank, self._layout, self._geometry = engine_id, rank, layout, geometry
        self._caches, self._channel, self._peers, self._executor = caches, channel, peers, executor
        self._clock = channel.clock  # deadlines leave out pauses of this process (ncclkv._clock)
        self._stats, self._deadline_s = stats, deadline_s
        self._cond = threading.Condition()
        self._requests: dict[str, Expected] = {}
        self._hold_s = hold_s
        # Pushes landed before they are expected; recycling looked up at each call, like the other hand-backs
        self._stage = PushStage(staging_bytes, lambda tensor: self._caches.recycle(tensor))
        # Refusals (pushes that failed before this rank expected them, expected requests that failed or were
        # aborted) and pulls that ended here, each kept hold_s: see _ended.
        self._ended = EndedTransfers(hold_s)
        self._cpus = cpus
        self._decliner = Decliner(f"ncclkv-decline[{peer_id(engine_id, rank)}]", self._send_decline, self._lost,
                                  self._alive, cpus)
        # The largest (layer, route) slice this rank planned to receive (expected, or a push staged): what an
        # unwanted tensor may plausibly be (see _drain). Pulled slices are not bounded by staging_bytes.
        self._largest_slice = 0

    def expect(self, request_id: str, producer: EngineRef, block_ids: Sequence[int], tokens: SpanSet | int,
               push: bool = False, keep_tokens: int = 0, hold: int = 0) -> None:
        """Start receiving ``tokens`` of ``request_id`` from ``producer`` into ``block_ids``; returns at once.

        Pull (default): ask every producer rank. Push: the producer streams on
        its own; tensors that landed before this call are taken from staging;
        the first ``keep_tokens`` are not written (see ``TransferEngine.expect``).
        """
        if push and not isinstance(tokens, int):
            raise ValueError(f"request {request_id!r}: a pushed request carries all its tokens; pass their count")
        if keep_tokens and not (push and isinstance(keep_tokens, int) and 0 <= keep_tokens <= tokens):  # type: ignore[operator]
            raise ValueError(f"request {request_id!r}: keep_tokens={keep_tokens!r} needs a push of at least that "
                             f"many tokens (push={push}, tokens={tokens!r}); a pull asks only for what it lacks")
        token_set = SpanSet.range(0, tokens) if isinstance(tokens, int) else tokens
        slots = self._caches.slot_map(block_ids, token_set.bounds)
        if token_set.bounds.stop > slots.num_tokens:
            raise ValueError(f"request {request_id!r}: tokens {token_set!r} do not fit {len(block_ids)} blocks "
                             f"of {slots.block_size}")
        routes = cached_plan(producer.layout, self._layout, self._geometry, token_set).routes_to(self._rank)
        by_src: dict[int, list[Route]] = {src: [] for src in range(producer.layout.world_size)}
        for route in routes:
            by_src[route.src].append(route)
        pending = {(r.src, layer, r) for r in routes for layer in r.layers}
        per_src: dict[int, int] = {}
        remaining = {layer: 0 for layer in self._caches.shard.layers}
        for src, layer, _ in pending:
            per_src[src] = per_src.get(src, 0) + 1
            remaining[layer] += 1
        now = self._clock.now()
        req = Expected(request_id, producer, slots, pending, per_src, remaining, time.monotonic(), now, push=push,
                        num_tokens=token_set.bounds.stop if push else 0, keep=keep_tokens,
                        unsent=0 if push else sum(1 for src_routes in by_src.values() if src_routes),
                        since_seq=self._channel.loss_seq, hold=hold)
        staged_tensors: list[StagedTensor] = []
        with self._cond:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already expected")
            ended = None if push else self._ended.refusal(request_id, producer.engine_id)
            if ended is not None and not (ended.pulled and holds_differ(hold, ended.hold)):
                # The producer may still be sending the ended pull's tensors: a new pull under the same id would
                # take them (and its own again), and its Done would count for the other. Unless both pulls name
                # their holds: the ended one's announcements, Done and errors name its hold, and are not this one's.
                raise ValueError(f"request {request_id!r} from {producer.engine_id!r} ended here unloaded "
                                 f"{max(0.0, self._clock.now() - ended.since):.3g}s ago ({ended.error}); its late "
                                 f"tensors may still come for hold_s={self._hold_s:g}s: pull it under a new request id"
                                 + (" (or both pulls under hold numbers)" if ended.pulled else ""))
            pushed = None if push else self._stage.get(request_id)
            if pushed is not None and pushed.producer_engine_id == producer.engine_id:
                # Its tensors come unasked and wait in staging: a pull would wait deadline_s for an answer to it
                # that the producer, pushing, never sends.
                raise ValueError(f"request {request_id!r} is being pushed here by {producer.engine_id!r} (its "
                                 f"tensors wait in staging): expect it with push=True")
            self._requests[request_id] = req
            self._plan_slices_locked(routes)
            refused = self._ended.refusal(request_id, producer.engine_id) if push else None
            if push:
                self._ended.forget_refusal(request_id)
            if refused is not None:
                what = (self._ended.pull_ended_text(request_id, producer.engine_id, refused.since, self._clock.now())
                        if refused.pulled else "a push of it expected here before failed or was aborted"
                        if refused.expected else "its push failed before it was expected")
                req.error = type(refused.error)(f"request {request_id!r}: {what}: {refused.error}")
            taken = self._stage.take(request_id) if push else None
            if taken is not None:
                staged, staged_tensors = taken
                staged.taken_by = req  # what it announced and is still on the way lands here
                req.announced.update(staged.announced)
                for key, piece, _ in staged_tensors:  # here already: applied below
                    add_piece(req.received, key, piece)
                if staged.producer_engine_id != producer.engine_id:
                    req.error = ProtocolError(f"request {request_id!r} was pushed by {staged.producer_engine_id!r}, "
                                              f"expected from {producer.engine_id!r}")
                req.error = req.error or staged.error
                if req.error is None and staged.num_tokens != req.num_tokens:
                    req.error = ShapeMismatchError(f"request {request_id!r} was pushed with {staged.num_tokens} "
                                                   f"tokens, expected here with {req.num_tokens}")
                self._stage.report_removed(staged, "taken" if req.error is None else "failed")
        if staged_tensors:
            with pinned(self._cpus):  # scattered on this thread (EngineConfig.cpus)
                for key, piece, tensor in staged_tensors:
                    self._apply(req, (key,), piece, tensor, None)
        if push:
            return
        for src, src_routes in by_src.items():
            # A failure past _pull's own handling fails the request; an empty pull's is only logged. In the producer
            # rank's lane of the executor: after our earlier tasks for it, never behind another peer's.
            submit_task(self._executor, f"pull of {request_id} from {producer.peer_id(src)}",
                        partial(self._pull_failed, req, src) if src_routes else None,
                        self._pull, req, src, src_routes, token_set, peer=producer.peer_id(src),
                        at=producer.control_addrs[src])

    def decline(self, request_id: str, producer: EngineRef, push: bool = False, hold: int = 0) -> None:
        """This rank will not take ``request_id``; returns at once.

        Pull: tell every rank of ``producer`` (a pull of nothing, what a rank the plan gives nothing
        sends): once every consumer rank said so or pulled, the producer frees its blocks instead of
        holding them ``hold_s``. Push: what is staged for it is given back now, and its producer's later
        offers are refused (its push then ends, and the producer frees the blocks)."""
        with self._cond:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is expected here: abort() it instead of declining it")
            if push:
                self._fail_unexpected_push_locked(request_id, producer.engine_id, TransferError(
                    f"push of {request_id!r} was declined here (its request ended unloaded)"))
                return
            self._ended.note_pull(request_id, producer.engine_id, self._clock.now())
        self._decliner.queue(request_id, producer, range(producer.layout.world_size), hold)

    def wait_layer(self, request_id: str, layer: int, timeout_s: float | None = None) -> None:
        """Block until ``layer`` of ``request_id`` has landed; raise the request's error if it failed."""
        if layer not in self._caches.shard.layers:
            raise ValueError(f"layer {layer} is not on this rank (layers {self._caches.shard.layers!r})")
        events = self._wait(request_id, lambda req: req.remaining[layer] == 0, timeout_s, f"layer {layer}",
                            lambda req: req.scattered.get(layer, ()))
        self._caches.order_after(events)  # CUDA: the caller's next kernels (the layer's attention) read it after

    def wait_all(self, request_id: str, timeout_s: float | None = None) -> None:
        events = self._wait(request_id, lambda req: not req.pending, timeout_s, "all layers",
                            Expected.all_scattered)
        self._caches.order_after(events)

    def wait_finished(self, timeout_s: float) -> bool:
        """Block until some expected request completed or failed (what :meth:`take_finished` would report,
        stalls aside) or ``timeout_s`` passed; return whether one did. Waits on the condition every landed
        tensor notifies, so the caller holds no GIL meanwhile."""
        with self._cond:
            return self._cond.wait_for(lambda: any(
                (r.error is not None or not r.pending) and r.applying == 0 for r in self._requests.values()
            ), timeout_s)

    def take_finished(self) -> dict[str, BaseException | None]:
        """Requests that completed or failed since the last call (a stalled one fails here too)."""
        now = self._clock.now()
        with self._cond:
            stalled = any(r.error is None and r.pending and now > self._stall_at(r) for r in self._requests.values())
        if stalled:  # judge it only once a pause of this process, if any, is counted
            self._clock.settle()
            now = self._clock.now()
        out: dict[str, BaseException | None] = {}
        scattered: list[torch.cuda.Event] = []
        with self._cond:
            for request_id, req in list(self._requests.items()):
                if req.error is None and req.pending and now > self._stall_at(req):
                    self._fail_locked(req, self._stall_error(req))
                if (req.error is not None or not req.pending) and req.applying == 0:
                    out[request_id] = req.error
                    scattered += req.all_scattered()
                    del self._requests[request_id]
                    self._stats.record_request(req.error is not None)
                    self._note_ended_pull(req, now)
                    if req.error is not None:  # a late offer for it is refused, a pull of it again too
                        self._remember_refusal(request_id, req.producer.engine_id, as_ncclkv(req.error),
                                               pulled=not req.push, hold=req.hold, expected=req.push)
            self._ended.expire(now)
            for request_id, staged in self._stage.expire(now, self._hold_s):  # pushed, never expected here
                if staged.error is None:
                    log.warning("dropping pushed request %s: not expected within %ss", request_id, self._hold_s)
                # An expect() after this fails at once (it would wait hold_s for tensors that never come).
                self._remember_refusal(request_id, staged.producer_engine_id, as_ncclkv(
                    staged.error or TransferTimeout(f"push of {request_id!r} expired in staging after "
                                                    f"{self._hold_s:g}s, not expected here")))
        # CUDA: reported done (or failed: recomputed) once on the device too
        self._wait_device(scattered, "finished loads")
        return out

    def abort(self, request_id: str) -> None:
        """Stop filling ``request_id``'s blocks (late tensors are received and dropped).

        When this returns no scatter into its blocks is running, so they may be reused."""
        with self._cond:
            req = self._requests.pop(request_id, None)
            if req is not None:
                self._stats.record_abort()  # not reported any more: counted here, once
            if req is not None and req.error is None:
                req.error = TransferError(f"request {request_id!r} aborted")
            if req is not None:  # a later offer for it is refused, not staged for no one; a pull of it again too
                self._remember_refusal(request_id, req.producer.engine_id, as_ncclkv(req.error),
                                       pulled=not req.push, hold=req.hold, expected=req.push)
                self._note_ended_pull(req, self._clock.now())
            self._cond.notify_all()
            limit = time.monotonic() + self._deadline_s
            while req is not None and req.applying and time.monotonic() < limit:
                self._cond.wait(limit - time.monotonic())
            if req is not None and req.applying:  # never silent: the caller is about to reuse these blocks
                log.error("request %s aborted, but %d scatter(s) into its blocks still ran after %ss",
                          request_id, req.applying, self._deadline_s)
            scattered = [] if req is None else req.all_scattered()
        # CUDA: the blocks are the caller's once the device is past them too
        self._wait_device(scattered, f"aborted request {request_id}")

    def _wait_device(self, scattered: list[torch.cuda.Event], what: str) -> None:
        """Wait (deadline_s at most) for CUDA scatters to be done on the device; never silent when they are not."""
        stuck = self._caches.wait_done(scattered, self._deadline_s)
        if stuck:
            log.error("%d of %d scatter(s) into the blocks of %s still not done on the device after %ss; the "
                      "blocks are handed back anyway", stuck, len(scattered), what, self._deadline_s)

    def close(self) -> None:
        with self._cond:
            for request_id, req in self._requests.items():  # their waiters see it now, not a stall after deadline_s
                if req.error is None:
                    req.error = ClosedError(f"engine rank {peer_id(self._engine_id, self._rank)} closed while request "
                                            f"{request_id!r} was expected")
            self._stage.clear()
            self._ended.clear()
            self._cond.notify_all()
        self._decliner.close()
        self._stage.close()

    def take_staging_events(self) -> list[StagingEvent]:
        """Staging events (pushed KV stored in / removed from staging) since the last call, in order."""
        return self._stage.take_events()

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._requests)

    # -- control messages (dispatcher thread) ----------------------------------------------
    def on_announce(self, sender: str, ann: Announce) -> None:
        # The link it names, never waited for here: with it still opening (the peer's end opened first), every
        # other peer's messages would wait behind it. Its receive is posted once it opens, after those of the
        # announcements before it on that link (PeerLinks.when_open keeps their order: receives match sends).
        peer = self._peers.link_peer(sender, ann.link)
        self._peers.when_open(peer, partial(self._on_announce_open, sender, peer, ann))

    def _on_announce_open(self, sender: str, peer: Peer, ann: Announce, link: LinkBase | None,
                          error: BaseException | None) -> None:
        """Post the receive of an announced tensor on its open link (on the dispatcher, or once the link opened
        on the thread that opened it); ``error``: the link never opened, and its request fails with that."""
        if link is None:
            assert error is not None
            log.warning("announcement seq %d of %r from %s: link %s never opened: %s", ann.seq, ann.request_id,
                        sender, ann.link, error)
            self._fail_announced(peer.remote.engine_id, ann.request_id, ann.hold, as_ncclkv(error))
            return
        want_seq = peer.heard_seq  # the link's: when_open runs one announcement of a link at a time, in order
        if ann.seq != want_seq:
            self._peers.drop(sender, f"announcement seq {ann.seq}, expected {want_seq}")
            self.fail_peer(sender, ProtocolError(f"{sender!r} announced seq {ann.seq}, expected {want_seq}"))
            return
        peer.heard_seq = want_seq + 1
        # The tensor is on its way whatever we make of it: one receive must be posted for it (its wire buffer, or
        # scratch), or the link's next receive takes its bytes and every later request lands wrong KV silently.
        try:
            self._receive(sender, peer.remote.rank, peer.remote.engine_id, link, ann)
        except Exception as err:  # nothing posted: close the link rather than let it go out of step
            # A link a tensor broke (its header did not match its receive) fails what waits on it with that cause's
            # type: the request whose tensor it was may hear of it here first, before its own receive's error lands.
            cause = link.broken if isinstance(err, ClosedError) and link.broken is not None else err
            error = as_ncclkv(cause)
            reason = f"no receive posted for announcement seq {ann.seq} of {ann.request_id!r}: {as_ncclkv(err)}"
            self.fail_peer(sender, type(error)(f"{sender!r}: {reason}; link closed"))
            self._peers.drop(sender, reason)

    def _fail_announced(self, engine_id: str, request_id: str, hold: int, error: NcclKVError) -> None:
        """The tensor announced for ``request_id`` (its pull's hold ``hold``) by engine ``engine_id`` will never
        come: its request, or its staged push, fails with ``error`` (only that engine's: no one can fail another's
        request; nor a late one of an ended pull the request expected now under the id)."""
        with self._cond:
            req = self._requests.get(request_id)
            staged = self._stage.get(request_id) if req is None else None
            if _not_its(hold, 0 if req is None else req.hold):
                return
            if req is not None and req.producer.engine_id == engine_id:
                self._fail_locked(req, error)
            elif staged is not None and staged.producer_engine_id == engine_id and staged.error is None:
                self._stage.fail(request_id, staged, error)

    def _receive(self, sender: str, src: int, engine_id: str, link: LinkBase, ann: Announce) -> None:
        """Post the receive of one announced tensor from rank ``src`` of engine ``engine_id``: into a wire buffer
        if its request takes it (checked against the plan), else into scratch (``_drain``). Raises only if
        nothing was posted."""
        route = Route(ann.route.src, ann.route.dst, *ann.route.spans())
        # At most the model's layers (a peer's count sizes this tuple; more can only be refused, see below).
        stop = ann.layer + min(ann.num_layers, self._geometry.num_layers + 1)
        keys = tuple((src, layer, route) for layer in range(ann.layer, stop))
        piece = route.tokens if ann.piece is None else Span(*ann.piece)
        shape = self._caches.wire_shape(piece, route.heads, ann.num_layers)

        def what() -> str:  # built only for a problem: formatting spans costs more than the checks
            return f"{sender!r} announced {layers_text(keys)} {route}" + (
                "" if ann.piece is None else f" tokens {piece!r}")
        problem = None
        failure: type[NcclKVError] = ShapeMismatchError  # what the request fails with, for a problem of its own
        buf: torch.Tensor | None = None
        with self._cond:
            req = self._requests.get(ann.request_id)
            staged = self._stage.get(ann.request_id) if req is None else None
            # Only the request's producer can fail it: any handshaken engine can announce (its tensor is drained).
            owner = req.producer.engine_id if req is not None else staged.producer_engine_id if staged else None
            own = owner == engine_id
            if owner is not None and not own:
                problem = f"{what()} for request {ann.request_id!r}, whose producer is {owner!r}"
            elif owner is not None and _not_its(ann.hold, 0 if req is None else req.hold):
                # A late one of an ended pull of the id (a push, expected or staged, names no hold)
                problem = f"{what()} for hold {ann.hold} of {ann.request_id!r}, {_taken_as(req)}"
                own = False  # drained: the request expected here (or the push staged) is not failed for it
            elif piece.empty or not route.tokens.covers(piece):
                problem = f"{what()}: the piece is empty or outside the route's tokens"
            elif ann.num_layers > self._geometry.num_layers:
                problem = f"{what()}: {ann.num_layers} layers in one tensor, the model has {self._geometry.num_layers}"
            elif len(keys) > 1 and (staged is not None or (req is not None and req.push)):
                # Only pulls batch layers: a push sends each layer as it is saved (a staged tensor is one slice's).
                problem = f"{what()} in one tensor for push {ann.request_id!r}: a push sends a layer per tensor"
            elif staged is not None:
                if staged.error is not None or keys[0] not in staged.keys:
                    problem = f"{what()} which push {ann.request_id!r} did not offer"
                elif tuple(ann.shape) != shape or ann.dtype != self._geometry.dtype:
                    problem = f"announced {tuple(ann.shape)} {ann.dtype}, the plan says {shape} {self._geometry.dtype}"
                elif overlaps(staged.announced, keys[0], piece):
                    problem = f"{what()} of push {ann.request_id!r} again"
            elif req is None or req.error is not None:
                problem = f"request {ann.request_id!r} is not expected (finished, failed or aborted)"
            elif any(key not in req.pending for key in keys):
                problem = f"{what()} which request {ann.request_id!r} does not expect"
            elif tuple(ann.shape) != shape or ann.dtype != self._geometry.dtype:
                problem = f"announced {tuple(ann.shape)} {ann.dtype}, the plan says {shape} {self._geometry.dtype}"
            elif any(overlaps(req.announced, key, piece) for key in keys):
                problem = f"{what()} of request {ann.request_id!r} again"
            if problem is None:
                # Taken before anything is recorded: if it fails (out of memory), the request fails alone and
                # its tensor is drained, as for any announcement it cannot take.
                try:
                    buf = self._caches.wire_buffer(piece, route.heads, exact=req is None,  # staged: held long
                                                   layers=len(keys))
                except Exception as err:
                    problem, failure = f"no wire buffer for {what()}: {type(err).__name__}: {err}", TransferError
            if buf is not None:
                if req is not None:
                    for key in keys:
                        add_piece(req.announced, key, piece)
                    req.links[src] = link
                    req.progress = self._clock.now()  # an announcement is progress: its tensor is on the way
                else:
                    assert staged is not None
                    add_piece(staged.announced, keys[0], piece)
            elif own and staged is not None and staged.error is None:
                # Its expect() fails at once, not after a stall.
                self._stage.fail(ann.request_id, staged, failure(problem))
        if buf is not None:
            out: torch.Tensor = buf
            try:
                future = link.recv(shape, self._caches.wire_dtype, out=out)
            except BaseException:
                self._caches.recycle(out)  # never posted: nothing writes it
                raise
            owner = req if req is not None else staged  # the tensor is this one's: never another's under its id
            future.add_done_callback(lambda fut: self._landed(ann.request_id, owner, keys, piece, out, fut))
            return
        assert problem is not None
        log.warning("dropping announced tensor from %s: %s", sender, problem)
        if own and req is not None and req.error is None:
            self._fail(req, failure(problem))
        self._drain(sender, link, ann)

    def on_push_offer(self, sender: str, offer: PushOffer) -> Ack:
        """Accept a producer's push: direct if the request is expected, else reserve staging or refuse."""
        peer = self._peers.known(sender)
        if peer is None:  # answered peer_reset: the producer shakes hands again and offers once more
            raise PeerResetError(f"push offer for {offer.request_id!r} from {sender!r} before any handshake (none "
                                 f"held here: it was lost, or this process restarted)")
        if not self._caches.registered:  # its tensors could not be received: refuse it now
            raise TransferError(f"push of {offer.request_id!r} from {sender!r}: this rank has no KV caches registered")
        checked = check_offer(offer, sender, peer.remote, self._layout, self._geometry, self._rank)
        with self._cond:
            req = self._requests.get(offer.request_id)
            if req is not None:
                if req.producer.engine_id != offer.producer_engine_id:
                    raise ProtocolError(f"push of {offer.request_id!r} from engine {offer.producer_engine_id!r}, "
                                        f"expected from {req.producer.engine_id!r}")
                if req.error is not None:  # not yet reported: its tensors would only cross the link to be drained
                    raise refused_offer(offer, sender, req.error)
                mismatch = ("expected here as a pull, not a push" if not req.push else
                            f"expected here with {req.num_tokens} tokens, pushed with {offer.num_tokens}"
                            if offer.num_tokens != req.num_tokens else None)
                if mismatch is not None:  # fails here and there at once, not at a stall after deadline_s
                    error = ShapeMismatchError(f"push of {offer.request_id!r} from {sender!r}: {mismatch}")
                    self._fail_locked(req, error)
                    raise error
                return Ack(offer.request_id, None)
            staged = self._stage.get(offer.request_id)
            if staged is not None and staged.producer_engine_id != offer.producer_engine_id:
                raise ProtocolError(f"push of {offer.request_id!r} from engine {offer.producer_engine_id!r}: "
                                    f"staged here from {staged.producer_engine_id!r}")  # never another's to fail
            refused = self._ended.refusal(offer.request_id, offer.producer_engine_id)
            if staged is None and refused is not None and refused.pulled:  # no push failed: a pull of the id did
                raise refused_offer(offer, sender, refused.error, self._ended.pull_ended_text(
                    offer.request_id, offer.producer_engine_id, refused.since, self._clock.now()))
            failed = staged.error if staged is not None else refused.error if refused is not None else None
            if failed is not None:  # another rank's part failed, or it was refused or expired: nothing to stage
                raise refused_offer(offer, sender, failed)
            if checked.nbytes > self._stage.capacity_bytes - self._stage.reserved_bytes:
                refusal = CapacityError(
                    f"push of {offer.request_id!r} from {sender!r} needs {checked.nbytes} B of staging; capacity "
                    f"{self._stage.capacity_bytes} B, {self._stage.reserved_bytes} B already reserved")
                if staged is not None:  # the parts other ranks staged are of no use now: give them back
                    self._stage.fail(offer.request_id, staged, refusal)
                else:
                    self._remember_refusal(offer.request_id, offer.producer_engine_id, refusal)
                raise refusal
            self._stage.reserve(offer.request_id, offer.producer_engine_id, self._clock.now(), offer.num_tokens,
                                checked.wanted, checked.blocks, checked.keys, checked.nbytes)
            self._plan_slices_locked(checked.routes)
        return Ack(offer.request_id, None)

    def on_done(self, sender: str, done: Done) -> None:
        peer = self._peers.known(sender)
        if peer is None:  # anyone can reach our ROUTER: only a peer we shook hands with speaks for a request
            raise ProtocolError(f"Done for {done.request_id!r} from {sender!r} before any handshake")
        src = peer.remote.rank
        with self._cond:
            req = self._requests.get(done.request_id)
            if req is None or req.error is not None:
                return
            if req.producer.engine_id != peer.remote.engine_id:
                raise ProtocolError(f"Done for {done.request_id!r} from {sender!r}, which is not its producer "
                                    f"{req.producer.engine_id!r}")
            if _not_its(done.hold, req.hold):  # an ended pull's of the id: it counts nothing of this one's
                log.info("Done from %s for hold %d of %s, %s: ignored", sender, done.hold, done.request_id,
                         _taken_as(req))
                return
            want = req.per_src.get(src, 0)
            if done.num_tensors != want:
                self._fail_locked(req, ProtocolError(
                    f"{sender!r} says it sent {done.num_tensors} (layer, route) slices of {done.request_id!r}, the plan says {want}"))

    def on_error(self, sender: str, err: ErrorMsg) -> None:
        if err.request_id is None:
            log.error("error from %s: %s %s", sender, err.code.value, err.text)
            return
        peer = self._peers.known(sender)
        with self._cond:
            req = self._requests.get(err.request_id)
            if _not_its(err.hold, 0 if req is None else req.hold):
                # A pull's (a push names no hold), not the one expected here: an ended pull's late answer.
                log.info("error from %s for hold %d of %s, %s: %s", sender, err.hold, err.request_id,
                         "not expected here" if req is None else _taken_as(req), err.text)
                return
            if req is None and peer is not None and self._late_for_pull(err.request_id, peer.remote.engine_id):
                log.info("error from %s for %s, a pull that ended here: %s", sender, err.request_id, err.text)
                return
            if req is None and peer is not None and self._late_for_expected_push(err.request_id,
                                                                                  peer.remote.engine_id):
                # Its producer's answer to a push expected here that already ended (failed, aborted): that end stays
                # the refusal, not a push failing before it was expected.
                log.info("error from %s for %s, a push that ended here: %s", sender, err.request_id, err.text)
                return
            if req is None and peer is not None:  # a push that failed before it was expected here
                self._fail_unexpected_push_locked(err.request_id, peer.remote.engine_id, err.to_exception(sender))
                return
            if req is None or req.error is not None:
                return
            if sender not in {req.producer.peer_id(r) for r in range(req.producer.layout.world_size)}:
                log.warning("ignored error for %s from %s, not its producer: %s", err.request_id, sender, err.text)
                return
            rank = split_peer_id(sender)[1]
            if not req.push and not req.per_src.get(rank):
                # A rank this pull takes nothing from (its pull of nothing, or an earlier one under the id, parked
                # there until that rank's deadline_s): only logged, as when sending that pull of nothing failed.
                log.info("error from %s for %s, which takes nothing from it: %s", sender, err.request_id, err.text)
                return
            link = req.links.get(rank)
            if link is not None and link.broken is not None and awaits(req, rank):
                # We broke that link (a tensor other than announced, a receive that failed): the producer's sends
                # failed with it, and its error may come before ours, which is the cause. The link settles every
                # receive it had, each failing this request typed (a ShapeMismatchError names both sizes).
                log.info("error from %s for %s after this side broke their link (%s): %s", sender, err.request_id,
                         link.broken, err.text)
                return
            self._fail_locked(req, err.to_exception(sender))

    def fail_peer(self, peer_id: str, error: NcclKVError) -> None:
        """Fail every request that still waits for data from ``peer_id`` (one whose bytes from it all arrived is
        kept, their scatters running or done), staged pushes from its engine included (one that owes nothing more
        from that rank is kept: all its slices from it landed, or the plan gives it none from that rank).

        For a loss with a ``loss_seq`` (the channel's), a request expected after it was reported, or a pull
        acknowledged under a handshake made after it, is not the lost one's, nor is a pull or push from the rank
        at another address than the life lost (its ``address``: the producer restarted there); after a reset
        (:class:`PeerResetError`: the producer is there, it only dropped us, restarted or moved), a pull not
        acknowledged yet is left to shake hands again, and so is a push whose reference names the producer rank's
        life heard now (it restarted: the lost life is the one it replaced, and the new one pushes this one)."""
        engine_id, rank = split_peer_id(peer_id)
        seq = error.loss_seq if isinstance(error, PeerLostError) else None
        lost_at = error.address if isinstance(error, PeerLostError) else None
        reset = isinstance(error, PeerResetError)
        replaced = error.incarnation if reset else 0  # it restarted: the life lost, a new one speaks now
        with self._cond:
            for req in self._requests.values():
                if req.error is not None or req.producer.engine_id != engine_id:
                    continue
                if not any(key[0] == rank and not covers_slice(req.received.get(key), key) for key in req.pending):
                    continue  # nothing more to come from it (its last bytes may be being scattered)
                if seq is not None and req.since_seq >= seq:  # expected after the loss was reported
                    continue
                named = req.producer.incarnation(rank) if req.push and replaced else 0
                if named and named != replaced and named == self._channel.peer_incarnation(peer_id):
                    continue  # its reference names the life that replaced the lost one: that one pushes it
                if not lost_there(lost_at, req.producer.control_addrs[rank]):  # another life's (a pull or a push)
                    continue
                if not req.push:
                    stamp = req.acked.get(rank)
                    if stamp is None and reset:  # its pull is still to be (re)sent, under a new handshake
                        continue
                    if stamp is not None and seq is not None and stamp >= seq:  # pulled after the loss
                        continue
                self._fail_locked(req, error)
            for request_id, staged in self._stage.items():  # only a push that still waits for that rank's bytes
                if staged.error is None and staged.producer_engine_id == engine_id and staged.owes(rank):
                    self._stage.fail(request_id, staged, error)

    # -- internals ------------------------------------------------------------------------
    def _send_decline(self, request_id: str, producer: EngineRef, src: int, hold: int) -> None:
        """On the decline threads (see ``_declines``): a pull of nothing (of hold ``hold``) to producer rank
        ``src``."""
        self._send_pull(request_id, producer, src, [], SpanSet(()), hold)

    def _alive(self, peer_id: str) -> bool:
        return self._channel.peer_alive(peer_id)

    def _lost(self, peer_id: str, address: str, incarnation: int = 0) -> bool:
        """Whether the life of ``peer_id`` at ``address`` is gone (a decline to it there is skipped): the channel
        gave up the peer, which we shook hands with or connected to there (or we shook hands there with a life of it
        that a later one replaced), or reaches it at another address now (it restarted there). Sent, a decline
        would connect to the lost life anew: the channel would count it alive for another deadline_s, and its loss,
        reported once more then, would fail the requests expected from the peer id meanwhile; to a dead address
        while the peer lives at another one, it would hold the peer's handshake gate for deadline_s, or move the
        channel back there (a life never met is not told stale)."""
        at = self._channel.connected_address(peer_id)
        if self._channel.peer_alive(peer_id):
            return at is not None and at != address
        # The channel knows where the life lost last was; an earlier life's address, that life replaced, is dead too.
        return (at == address or self._peers.known(peer_id) is not None
                or self._peers.replaced_at(peer_id, address, incarnation))

    def _pull(self, req: Expected, src: int, routes: list[Route], tokens: SpanSet) -> None:
        """On the executor, in producer rank ``src``'s lane: ask it for ``routes`` of ``req``.

        A request that ended while this waited its turn (aborted, or failed: a lost producer fails
        all of its requests) is declined instead, on the decline threads: its producer frees the blocks,
        and no handshake with a producer that may be dead holds the lane the pulls after it wait for.
        A pull that finds the producer lost (or unanswering) fails the pulls queued behind it at once
        (``fail_fast``), rather than each waiting ``deadline_s`` on it."""
        request_id, producer = req.request_id, req.producer
        with self._cond:
            ended = self._requests.get(request_id) is not req or req.error is not None
        if ended:
            self._decliner.queue(request_id, producer, (src,), req.hold)
            return
        try:
            peer = self._send_pull(request_id, producer, src, routes, tokens, req.hold)
        except Exception as err:  # the request fails; the error names the producer rank
            log.log(logging.ERROR if routes else logging.WARNING, "%s of %s from %s failed: %s",
                    "pull" if routes else "empty pull (nothing to receive)", request_id, producer.peer_id(src), err)
            if routes:
                self._pull_failed(req, src, err)
            fail_fast(self._executor, producer.peer_id(src), err, self._channel.peer_alive,
                      at=producer.control_addrs[src])
            return
        if routes:
            with self._cond:
                req.acked[src] = peer.stamp
                req.unsent -= 1
                req.progress = self._clock.now()  # its no-progress deadline counts from here (see _stall_at)
                self._cond.notify_all()  # a waiter's stall limit may have dropped from hold_s to deadline_s

    def _pull_failed(self, req: Expected, src: int, error: BaseException) -> None:
        """The pull of ``req``'s routes from producer rank ``src`` failed: the request fails (once) with ``error``."""
        self._fail(req, as_ncclkv(error))
        if not isinstance(error, (HandshakeError, ClosedError)):  # it may hold the request (a restarted producer,
            # a lost acknowledgement): tell it we will not take it, so it frees the blocks now, not after hold_s
            self._decliner.queue(req.request_id, req.producer, (src,), req.hold)

    def _send_pull(self, request_id: str, producer: EngineRef, src: int, routes: list[Route],
                   tokens: SpanSet, hold: int) -> Peer:
        """Shake hands with producer rank ``src`` if needed and send it the pull (for hold ``hold`` of the id);
        returns once it is acknowledged, the handshake it went under (once more under a new one after a reset:
        :meth:`PeerLinks.request`)."""
        pull = PullRequest(request_id, self._rank, self._engine_id, tuple(RouteMsg.from_route(r) for r in routes),
                           tokens.bounds.stop, hold)
        return self._peers.request(producer.peer_id(src), producer.control_addrs[src], pull, bool(routes),
                                   f"pull of {request_id}", incarnation=producer.incarnation(src),
                                   check=partial(self._check_layout, request_id, producer))

    def _check_layout(self, request_id: str, producer: EngineRef, peer: Peer) -> None:
        """The layout the reference gave (what the routes were planned from) is the one the producer shook hands
        with; else the pull would be refused by the producer's plan, naming routes instead of the cause."""
        said, runs = producer.layout, peer.remote.layout.to_layout()
        layers = self._geometry.num_layers
        if (said.tp_size, said.pp_size) != (runs.tp_size, runs.pp_size) or (
                pp_layer_spans(layers, said.pp_size, said.layer_partition)
                != pp_layer_spans(layers, runs.pp_size, runs.layer_partition)):
            raise HandshakeError(f"request {request_id!r}: the reference to {producer.engine_id!r} says layout "
                                 f"{said.spec()}, its rank {peer.peer_id!r} shook hands with {runs.spec()}")

    def _landed(self, request_id: str, owner: Expected | StagedPush | None, keys: tuple[SliceKey, ...],
                piece: Span, buf: torch.Tensor, fut: Future[torch.Tensor]) -> None:
        """On the link's receive thread (a done-callback of the receive): stage a landed tensor, or scatter it
        unless its request failed.

        A done-callback's exception is only logged by ``concurrent.futures``: the tensor would be lost, its wire
        buffer never handed back, and its request would find out by a stall. So whatever fails here fails that
        request (or staged push) at once, typed and naming it, and the buffer, unless it was handed on, goes back.
        """
        owned = [True]  # buf is still ours: neither in the store nor handed to _apply (which hands it back)
        try:
            self._land(request_id, owner, keys, piece, buf, fut, owned)
        except Exception as err:  # noqa: BLE001 - reported on the request, never lost in a callback's log
            self._landing_failed(request_id, owner, keys, piece, buf if owned[0] else None, fut, err)

    def _land(self, request_id: str, owner: Expected | StagedPush | None, keys: tuple[SliceKey, ...], piece: Span,
              buf: torch.Tensor, fut: Future[torch.Tensor], owned: list[bool]) -> None:
        error = fut.exception()
        with self._cond:
            req, staged = self._owner_now(request_id, owner)
            if req is None:
                if staged is not None and error is not None:
                    self._stage.fail(request_id, staged, error)
                if staged is not None and staged.error is None and len(keys) == 1:
                    self._stage.put(request_id, keys[0], piece, buf)
                    owned[0] = False  # the store holds it: given back with the staged push
                    self._stage.landed(request_id, staged, keys[0], piece)
                else:  # its push failed (now or before), or its request ended (aborted, expired): nothing takes it
                    owned[0] = False
                    self._caches.hand_back(buf, completed=error is None)
                return
            if error is None:  # its bytes are here: a loss of their sender now takes nothing (fail_peer)
                for key in keys:
                    add_piece(req.received, key, piece)
        owned[0] = False
        self._apply(req, keys, piece, buf, error)

    def _owner_now(self, request_id: str,
                   owner: Expected | StagedPush | None) -> tuple[Expected | None, StagedPush | None]:
        """What a tensor announced for ``owner`` lands in now (the request, or else the staged push; None: nothing):
        ``owner`` itself, or the request expect() made of it (a staged push), never a later request or push
        under the same id: an aborted pull's late tensors would write another producer's KV into it, silently.
        With the lock held."""
        req = self._requests.get(request_id)
        if req is not None and (req is owner or (isinstance(owner, StagedPush) and owner.taken_by is req)):
            return req, None
        staged = self._stage.get(request_id)
        return None, staged if staged is not None and staged is owner else None

    def _landing_failed(self, request_id: str, owner: Expected | StagedPush | None, keys: tuple[SliceKey, ...],
                        piece: Span, buf: torch.Tensor | None, fut: Future[torch.Tensor], err: Exception) -> None:
        """A landed tensor could not be taken (staged or scattered): fail its request, or its staged push (which
        gives back its staging), with a TransferError naming it; hand ``buf`` back if it is still ours."""
        src, _, route = keys[0]
        error = TransferError(f"request {request_id!r}: the tensor of {layers_text(keys)} from rank {src} (tokens "
                              f"{piece!r} of {route!r}) landed but could not be taken: {type(err).__name__}: {err}")
        log.error("%s", error, exc_info=err)
        try:
            with self._cond:
                req, staged = self._owner_now(request_id, owner)
                if req is not None:
                    self._fail_locked(req, error)
                elif staged is not None and staged.error is None:
                    self._stage.fail(request_id, staged, error)
        finally:
            if buf is not None:
                self._caches.hand_back(buf, completed=not fut.cancelled() and fut.exception() is None)

    def _apply(self, req: Expected, keys: tuple[SliceKey, ...], piece: Span, buf: torch.Tensor,
               error: BaseException | None) -> None:
        """Scatter one landed tensor (``piece`` of the slices ``keys``: one, or several layers' stacked) into the
        request's blocks and count it."""
        received = error is None
        with self._cond:
            if req.error is not None:
                self._caches.hand_back(buf, received)  # nothing reads it any more
                return
            req.applying += 1  # abort() and take_finished() wait for this scatter
        done = None
        if received:
            queued = 0  # layers whose scatter was queued (CUDA: kernels the blocks' hand-back must wait for)
            try:
                for i, (_, layer, route) in enumerate(keys):
                    self._scatter(req, layer, buf if len(keys) == 1 else buf[i], piece, route.heads)
                    queued += 1
            except Exception as err:  # reported on the request
                error = err
            if queued:  # also when a later layer's scatter failed: the earlier ones still write the blocks
                try:
                    done = self._caches.scattered(buf)
                except Exception as err:  # noqa: BLE001 - reported on the request
                    error = error or err
        try:  # read by the scatter if at all: only its shape is read below
            self._caches.hand_back(buf, received)
        except Exception as err:  # noqa: BLE001 - the count below must still drop (abort() waits for it)
            error = error or err
        slice_bytes = buf.numel() * buf.element_size() // len(keys)
        with self._cond:
            if done is not None:  # before the layers count as landed: their waiters take every event
                for key in keys:
                    req.scattered.setdefault(key[1], []).append(done)
            req.applying -= 1
            self._cond.notify_all()
            if error is not None:
                self._fail_locked(req, error if isinstance(error, NcclKVError) else TransferError(str(error)))
                return
            if req.error is not None:
                return
            for key in keys:
                if key not in req.pending:
                    continue
                landed = add_piece(req.landed, key, piece)
                if landed is None:
                    continue
                req.progress = self._clock.now()
                req.nbytes += slice_bytes
                if covers_slice(landed, key):  # else more pieces of this slice are to come
                    req.pending.discard(key)
                    layer = key[1]
                    req.remaining[layer] -= 1
                    if req.remaining[layer] == 0:
                        self._stats.record_layer(layer, time.monotonic() - req.started)
            self._cond.notify_all()
        self._stats.record_tensor(buf.numel() * buf.element_size())

    def _scatter(self, req: Expected, layer: int, buf: torch.Tensor, piece: Span, heads: Span) -> None:
        """Write a landed piece into the request's blocks, leaving out the tokens it keeps (``Expected.keep``)."""
        if piece.start >= req.keep:
            self._caches.scatter(layer, buf, req.slots, piece, heads)
        elif piece.stop > req.keep:  # straddles: its tail only, copied out (the wire dim 1 is the token)
            tail = buf[:, req.keep - piece.start:].contiguous()
            self._caches.scatter(layer, tail, req.slots, Span(req.keep, piece.stop), heads)

    def _drain(self, sender: str, link: LinkBase, ann: Announce) -> None:
        """Receive an unwanted tensor into scratch to keep the link in step, or break the link if implausible:
        larger than any slice this rank planned to receive (a peer's lie would size our scratch)."""
        itemsize = DTYPE_SIZES.get(ann.dtype)
        numel = math.prod(ann.shape)
        most = self._largest_slice * min(ann.num_layers, len(self._caches.shard.layers))  # a pull's run of layers
        if itemsize is None or numel * itemsize != ann.nbytes or ann.nbytes > most:
            layers = "" if ann.num_layers == 1 else f", {ann.num_layers} layers announced in it"
            reason = (f"implausible announcement {tuple(ann.shape)} {ann.dtype} {ann.nbytes} B (the largest slice "
                      f"planned here is {self._largest_slice} B{layers})")
            # Fail its requests first: once the link is closed (what the peer sees), they have failed.
            self.fail_peer(sender, ProtocolError(f"{sender!r} sent an {reason}; link closed"))
            self._peers.drop(sender, reason)
            return
        link.recv(tuple(ann.shape), torch_dtype(ann.dtype))

    def _wait(self, request_id: str, ready: Callable[[Expected], bool], timeout_s: float | None, what: str,
              events: Callable[[Expected], Iterable[torch.cuda.Event]]) -> list[torch.cuda.Event]:
        """Block until ``ready(req)``; the request's ``events`` then (taken under the lock)."""
        limit = None if timeout_s is None else self._clock.now() + timeout_s
        settled_for: float | None = None  # the stall time last checked against a settled clock
        with self._cond:
            while True:
                req = self._requests.get(request_id)
                if req is None:
                    raise ValueError(f"request {request_id!r} is not expected (or was already taken as finished)")
                if req.error is not None:
                    raise req.error
                if ready(req):
                    return list(events(req))
                now = self._clock.now()
                stall_at = self._stall_at(req)
                if now >= stall_at and settled_for != stall_at:  # count a pause of this process first
                    settled_for = stall_at
                    self._cond.release()
                    try:
                        self._clock.settle()
                    finally:
                        self._cond.acquire()
                    continue
                if now >= stall_at:
                    self._fail_locked(req, self._stall_error(req))
                    continue
                if limit is not None and now >= limit:
                    raise TransferTimeout(f"request {request_id!r}: {what} not landed within {timeout_s}s")
                self._cond.wait(min(stall_at, limit if limit is not None else stall_at) - now)

    def _fail_unexpected_push_locked(self, request_id: str, producer_engine_id: str, error: NcclKVError) -> None:
        """Under ``self._cond``: a push of ``request_id`` not expected here ended with ``error`` (declined here, or
        failed at its producer): what is staged for it from that producer is given back, or, if nothing is,
        an expect() of it fails at once (a push staged from another producer is left alone)."""
        staged = self._stage.get(request_id)
        if staged is None:
            self._remember_refusal(request_id, producer_engine_id, error)
        elif staged.producer_engine_id == producer_engine_id and staged.error is None:  # else failed already
            self._stage.fail(request_id, staged, error)

    def _remember_refusal(self, request_id: str, producer_engine_id: str, error: NcclKVError,
                          pulled: bool = False, hold: int = 0, expected: bool = False) -> None:
        """Under ``self._cond``: ``request_id`` from ``producer_engine_id`` ended here with ``error`` (a push
        refused, failed or expired here; an expected request failed or aborted, ``pulled`` if it was a pull, of
        hold number ``hold``, ``expected`` if it was a push)."""
        self._ended.refuse(request_id, producer_engine_id, error, self._clock.now(), pulled, hold, expected)

    def _note_ended_pull(self, req: Expected, now: float) -> None:
        """Under ``self._cond``: ``req`` ended here (reported or aborted); if it was a pull, a producer's error for
        it from now on is a late answer to it."""
        if not req.push:
            self._ended.note_pull(req.request_id, req.producer.engine_id, now)

    def _late_for_pull(self, request_id: str, producer_engine_id: str) -> bool:
        """Under ``self._cond``: whether an error from ``producer_engine_id`` for ``request_id``, neither expected
        nor staged here, answers a pull of it that ended here (or its decline), rather than telling of a push."""
        return self._ended.pulled_from(request_id, producer_engine_id) and self._stage.get(request_id) is None

    def _late_for_expected_push(self, request_id: str, producer_engine_id: str) -> bool:
        """Under ``self._cond``: whether an error from ``producer_engine_id`` for ``request_id``, neither expected
        nor staged here, answers a push of it that was expected here and ended (failed or aborted)."""
        refused = self._ended.refusal(request_id, producer_engine_id)
        return refused is not None and refused.expected and self._stage.get(request_id) is None

    def _stall_at(self, req: Expected) -> float:
        """When ``req`` counts as stalled (see ``_stall_limit``)."""
        return req.progress + self._stall_limit(req)[0]

    def _stall_limit(self, req: Expected) -> tuple[float, str]:
        """How long ``req`` may go without progress, and which limit that is: ``deadline_s``.

        A pushed request whose first announcement has not come yet may wait
        ``hold_s`` instead (its prefill may be queued), but only while one of
        its producer ranks is known and alive here: a producer never heard
        from, or lost, gets ``deadline_s`` like any other. A pulled request
        counts from its last pull's acknowledgement; while a pull is not yet
        acknowledged it may wait ``hold_s``, as long as its producer holds it:
        the pull may wait in its producer rank's lane behind earlier tasks, and
        each of its own waits has a deadline.
        """
        if req.push and not req.announced and self._hold_s != self._deadline_s and any(
            self._peers.get(peer) is not None and self._channel.peer_alive(peer)
            for peer in {req.producer.peer_id(src) for src, _, _ in req.pending}
        ):
            return self._hold_s, "hold_s, a push not yet announced"
        if req.unsent and self._hold_s > self._deadline_s:
            # A pull waits its turn in its producer rank's lane (after earlier tasks for it) or for its answer.
            return self._hold_s, "hold_s, a pull not yet acknowledged"
        return self._deadline_s, "deadline_s"

    def _plan_slices_locked(self, routes: Sequence[Route]) -> None:
        """Under ``self._cond``: ``routes`` are to be received here (expected, or a push staged); an unwanted
        tensor up to the largest of their slices is plausible (see ``_drain``)."""
        for route in routes:
            nbytes = math.prod(self._caches.wire_shape(route.tokens, route.heads)) * self._caches.wire_dtype.itemsize
            self._largest_slice = max(self._largest_slice, nbytes)

    def _stall_error(self, req: Expected) -> TransferTimeout:
        missing = sorted({(src, layer) for src, layer, _ in req.pending})[:8]
        limit, which = self._stall_limit(req)
        # A push never announced is most often one its producer never started: it holds it for a pull instead
        # (producer and consumer set up for different modes), or its prefill never ran.
        hint = (f"; nothing of it was announced: {req.producer.engine_id!r} may hold it for a pull (expect it "
                f"without push=True), or not have run its prefill") if req.push and not req.announced else ""
        return TransferTimeout(
            f"request {req.request_id!r}: no progress for {limit:g}s ({which}); still missing "
            f"{len(req.pending)} (layer, route) slices, e.g. (src rank, layer) {missing}{hint}")

    def _fail(self, req: Expected, error: BaseException) -> None:
        with self._cond:
            self._fail_locked(req, error)

    def _fail_locked(self, req: Expected, error: BaseException) -> None:
        if req.error is None:
            req.error = error
            log.warning("request %s failed: %s", req.request_id, error)
        self._cond.notify_all()


def _not_its(hold: int, expected: int) -> bool:
    """Whether a producer's Announce, Done or ErrorMsg naming hold ``hold`` answers another pull than the one
    expected here under ``expected``: the producer names the pull's own number, and 0 for a push or a pull that
    named none, so one naming a number is never a push's, nor an unnamed pull's (``holds_differ`` would take it
    for them)."""
    return bool(hold) and hold != expected


def _taken_as(req: Expected | None) -> str:
    """How the id is taken here (``req``; None: a push staged), for a message naming another hold."""
    if req is None:
        return "staged here as a push"
    return (f"expected here for hold {req.hold}" if req.hold else "expected here as a push" if req.push
            else "expected here as a pull naming no hold")
