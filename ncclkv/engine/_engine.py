"""The transfer engine of one rank: wires channel, data plane, caches, producer and consumer sides."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .._affinity import pin_this_thread, pinned
from .._timeout import check_timeout
from ..channel import Channel, ReplyThen
from ..errors import ClosedError, HandshakeError, PeerLostError, PeerResetError, ProtocolError
from ..layout import SpanSet
from ..paged import CacheLayout
from ..protocol import (MAX_HOLD, MAX_ID_CHARS, Announce, Done, ErrorMsg, Handshake, Message, PullRequest, PushOffer,
                        check_encodable_id)
from ..transport import DataPlane, LinkFactory
from ._caches import RankCaches
from ._config import EngineConfig, EngineRef, is_int, parse_peer_id
from ._consumer import ConsumerSide
from ._links import PeerLinks
from ._producer import ProducerSide
from ._staging import BlockTokens, StagingEvent
from ._stats import EngineStats, StatsSnapshot
from ._tasks import PeerTasks

__all__ = ["TransferEngine"]

log = logging.getLogger("ncclkv.engine")

_LINK_OPENERS = 8  # links this rank opens at once as the responder; each waits only on its peer and the I/O thread
# The tasks that wait on one peer each (pulls, push offers) run in a lane per peer (PeerTasks): at most
# _TASKS_PER_PEER of a peer's at once (what the one 4-worker executor of every peer's tasks allowed: a peer's
# pulls overlap their round trips as before), at most _TASK_THREADS threads in all, started as lanes need them.
_TASKS_PER_PEER = 4
_TASK_THREADS = 64


class TransferEngine:
    """Moves KV slices of requests between this rank and the ranks of other engines.

    Producer: :meth:`register` the caches, :meth:`finish` a request to hold its
    blocks for the consumers, free them when :meth:`take_finished_sending`
    returns it. Consumer: :meth:`register`, :meth:`expect` a request from a
    producer (an :class:`EngineRef`), :meth:`wait_layer` per layer, and
    :meth:`take_finished_receiving` for completions and failures.
    ``transport`` defaults to a real :class:`DataPlane` (gloo on CPU, NCCL on
    CUDA); tests of the layers above may pass a loopback one.
    """

    def __init__(self, config: EngineConfig, *, transport: LinkFactory | None = None) -> None:
        # Every thread started here (channel, ZMQ, data-plane store) inherits the engine's CPUs; the executors'
        # threads, started later from whichever thread submits, pin themselves (ncclkv._affinity).
        with pinned(config.cpus):
            self._start(config, transport)

    def _start(self, config: EngineConfig, transport: LinkFactory | None) -> None:
        self.config = config
        cfg = config
        if cfg.cpus is not None:
            log.info("engine %s: its threads run on CPUs %s", cfg.peer_id, ",".join(map(str, sorted(cfg.cpus))))
        assert cfg.deadline_s is not None and cfg.heartbeat_s is not None and cfg.staging_bytes is not None
        self._closed = False
        self._stats = EngineStats()
        assert cfg.wire_cache_bytes is not None
        self._caches = RankCaches(cfg.layout, cfg.geometry, cfg.rank, cfg.wire_cache_bytes)
        # Pulls and push offers wait on their peer, up to deadline_s each when it is dead or stopped: a lane per
        # peer, so such a peer holds at most _TASKS_PER_PEER threads and delays no other peer's transfers (they
        # used to share 4 workers: 4 requests to one dead peer held every transfer of this rank for deadline_s).
        self._executor = PeerTasks(_TASK_THREADS, f"ncclkv-engine[{cfg.peer_id}]", initializer=pin_this_thread,
                                   initargs=(cfg.cpus,), per_peer=_TASKS_PER_PEER)
        # Responder-side link opens get threads of their own: tasks on the executor above wait for
        # links (a push waits for its link to open), so opening them there could starve: with every
        # worker waiting, the open that would release them never ran (seen in the quick soak).
        self._link_opener = ThreadPoolExecutor(max_workers=_LINK_OPENERS,
                                               thread_name_prefix=f"ncclkv-link-open[{cfg.peer_id}]",
                                               initializer=pin_this_thread, initargs=(cfg.cpus,))
        data_plane: LinkFactory | None = None
        channel: Channel | None = None
        try:  # a failure half-way leaves no thread or socket behind
            data_plane = transport if transport is not None else DataPlane(cfg.bind_host, cfg.deadline_s)
            self._data_plane: LinkFactory = data_plane
            self._channel = channel = Channel(
                cfg.peer_id, bind_host=cfg.bind_host, on_message=self._on_message,
                on_peer_lost=self._on_peer_lost, heartbeat_s=cfg.heartbeat_s, deadline_s=cfg.deadline_s,
                auth=cfg.auth,
            )
            local = Handshake.create(cfg.engine_id, cfg.role, cfg.rank, cfg.layout, cfg.geometry,
                                     self._channel.address, self._data_plane.address,
                                     incarnation=self._channel.incarnation)
            self._peers = PeerLinks(local, self._channel, self._data_plane, self._link_opener, cfg.device,
                                    cfg.deadline_s)
            self._producer = ProducerSide(cfg.rank, cfg.layout, cfg.geometry, self._caches, self._channel,
                                          self._peers, self._executor, self._stats, cfg.hold_s, cfg.deadline_s,
                                          cfg.piece_bytes, cfg.last_piece_bytes, cfg.pull_batch_bytes, cfg.cpus)
            self._consumer = ConsumerSide(cfg.engine_id, cfg.rank, cfg.layout, cfg.geometry, self._caches,
                                          self._channel, self._peers, self._executor, self._stats, cfg.deadline_s,
                                          cfg.staging_bytes, cfg.hold_s, cfg.cpus)
        except BaseException:
            if channel is not None:
                channel.close()
            if data_plane is not None and transport is None:
                data_plane.close()
            self._executor.shutdown(wait=True)
            self._link_opener.shutdown(wait=True)
            raise

    @property
    def address(self) -> str:
        """This rank's control address; gather every rank's into an :class:`EngineRef`."""
        return self._channel.address

    @property
    def incarnation(self) -> int:
        """This rank's life under its peer id (its channel's incarnation), for the :class:`EngineRef`
        beside its address: a peer refuses at once a reference to a life it saw replaced."""
        return self._channel.incarnation

    def register(self, kv_caches: Mapping[int, torch.Tensor], cache_layout: CacheLayout) -> None:
        """Register this rank's paged caches: global layer index -> tensor in ``cache_layout``."""
        self._check_open()
        self._caches.register(kv_caches, cache_layout)

    # -- producer ---------------------------------------------------------------------
    def start_push(self, request_id: str, consumer: EngineRef, block_ids: Sequence[int], num_tokens: int,
                   blocks: BlockTokens | None = None) -> None:
        """Push mode: stream ``request_id`` to ``consumer`` layer by layer as :meth:`save_layer` is called.

        ``blocks``: the prompt's full blocks (``BlockTokens.of_prompt``), which the consumer names in
        its staging events (:meth:`take_staging_events`) while the KV waits in its staging store."""
        self._check_open()
        _check_request_id(request_id)
        _check_num_tokens(request_id, num_tokens)
        if consumer.engine_id == self.config.engine_id:  # its offer would shake hands with this rank itself
            raise ValueError(f"request {request_id!r}: consumer engine {consumer.engine_id!r} is this engine")
        self._producer.start_push(request_id, consumer, block_ids, num_tokens, blocks)

    def save_layer(self, request_id: str, layer: int) -> None:
        """Push mode: ``layer`` of ``request_id`` is computed; its slices go on the wire. Returns at once."""
        self._check_open()
        _check_layer(request_id, layer)
        self._producer.save_layer(request_id, layer)

    def finish(self, request_id: str, block_ids: Sequence[int] | None = None, num_tokens: int | None = None, *,
               hold: int = 0) -> None:
        """Push mode: no more layers. Pull mode: hold the request's blocks until every consumer rank
        pulled them (or ``hold_s`` passes). Either way :meth:`take_finished_sending` reports it.

        ``hold`` (pull mode): a number naming this hold of the id, any int in [1, 2**63) that differs from the
        id's other holds; give the consumers the same one (``expect(..., hold=)``, ``decline(..., hold=)``),
        and a late pull or decline for another hold of the id (an id held again within ``hold_s``) is refused
        or counts for nothing, instead of being taken for this one. 0 (default): not named; a pull or decline
        is then taken for whichever hold of the id is here."""
        self._check_open()
        _check_request_id(request_id)
        if num_tokens is not None:
            _check_num_tokens(request_id, num_tokens)
        _check_hold(request_id, hold)
        self._producer.finish(request_id, block_ids, num_tokens, hold)

    def release(self, request_id: str) -> bool:
        """Pull mode: stop holding ``request_id`` (its consumers' pulls fail). :meth:`take_finished_sending`
        reports it, with an error, once no send from its blocks is running. False when it is not held."""
        return self._producer.release(request_id)

    def reclaim(self, request_id: str, *, reused: bool = False) -> bool:
        """The caller takes ``request_id``'s blocks back before its transfers ended (vLLM preempted it, and will
        write another request's KV there): a hold is released (as :meth:`release`), and a send of its pulls or of
        its push not announced yet fails instead of reading them (the pull or push fails, typed; its consumer is
        told). Sends announced already still read them: wait for :meth:`take_finished_sending` to report it, as
        long as you can, before writing them. ``reused=True``: the caller writes them now, whatever still runs: an
        announced send not gathered yet fails too, which breaks its link (the consumer waits for its bytes).
        False when the id is neither held nor being pushed."""
        return self._producer.reclaim(request_id, reused)

    def take_finished_sending(self) -> dict[str, BaseException | None]:
        """Held requests whose blocks may be freed now, with the error if a consumer was not served."""
        return self._producer.take_finished()

    # -- consumer ---------------------------------------------------------------------
    def expect(self, request_id: str, producer: EngineRef, block_ids: Sequence[int], tokens: SpanSet | int,
               *, push: bool = False, keep_tokens: int = 0, hold: int = 0) -> None:
        """Receive ``request_id`` into ``block_ids``; returns at once.

        Pull (default): ask the producer for ``tokens`` (all, or a set that
        leaves out the ones already cached here). Push: the producer streams
        every token on its own; ``tokens`` is their count, and the first
        ``keep_tokens`` of them, already in this engine's blocks (a local
        prefix hit, blocks other requests share), land but are not written.
        ``hold`` (pull): the number the producer's ``finish`` named this hold
        of the id with (0: not named); the producer refuses the pull if it
        holds the id under another number.
        A pull under the id of one from the same producer that failed or was
        aborted here within ``hold_s`` is refused (ValueError): that pull's
        tensors may still arrive. Unless both pulls name their holds, and the
        numbers differ: the producer names the pull's hold in what it says of
        it, and the ended pull's late tensors are drained.
        """
        self._check_open()
        _check_request_id(request_id)
        if not isinstance(tokens, SpanSet):
            _check_num_tokens(request_id, tokens, "tokens (a count, or a SpanSet)")
        if producer.engine_id == self.config.engine_id:
            raise ValueError(f"request {request_id!r}: producer engine {producer.engine_id!r} is this engine")
        _check_hold(request_id, hold, push)
        self._consumer.expect(request_id, producer, block_ids, tokens, push, keep_tokens, hold)

    def decline(self, request_id: str, producer: EngineRef, *, push: bool = False, hold: int = 0) -> None:
        """This rank will not take ``request_id``. Pull: tell ``producer``'s ranks, which free its blocks once
        every consumer rank pulled or declined, instead of holding them ``hold_s`` (``hold``: the number of the
        hold declined, as for :meth:`expect`: a decline that reaches a later hold of the id counts for nothing
        there). Push: give back what is staged for it now and refuse the rest. Returns at once."""
        self._check_open()
        _check_request_id(request_id)
        _check_hold(request_id, hold, push)
        self._consumer.decline(request_id, producer, push, hold)

    def wait_layer(self, request_id: str, layer: int, timeout_s: float | None = None) -> None:
        """Block until ``layer`` of ``request_id`` is in this rank's cache (that layer only).

        ``timeout_s``: None waits as long as the request makes progress (``deadline_s`` without any fails it);
        0 only looks; else a number of seconds > 0 (``ValueError`` for nan, inf or a negative one)."""
        _check_layer(request_id, layer)
        self._consumer.wait_layer(request_id, layer, None if timeout_s is None else _wait_timeout(timeout_s))

    def wait(self, request_id: str, timeout_s: float | None = None) -> None:
        """Block until every layer of ``request_id`` landed on this rank (``timeout_s`` as for :meth:`wait_layer`)."""
        self._consumer.wait_all(request_id, None if timeout_s is None else _wait_timeout(timeout_s))

    def abort(self, request_id: str) -> None:
        self._consumer.abort(request_id)

    def wait_finished_receiving(self, timeout_s: float) -> bool:
        """Block until an expected request landed or failed, or ``timeout_s`` passed; True if one did.

        For a caller with nothing else to do (an idle vLLM step): it sleeps on a
        condition instead of polling :meth:`take_finished_receiving`. ``timeout_s``: 0 only looks."""
        return self._consumer.wait_finished(_wait_timeout(timeout_s))

    def take_finished_receiving(self) -> dict[str, BaseException | None]:
        """Expected requests that landed (None) or failed (the error) since the last call."""
        return self._consumer.take_finished()

    def take_staging_events(self) -> list[StagingEvent]:
        """Pushed KV that waits in this rank's staging store (outside the registered caches): a
        ``stored`` event once all of a push's tensors for this rank landed there, a ``removed`` one
        when it leaves (taken by :meth:`expect`, expired after ``hold_s``, checked in
        :meth:`take_finished_receiving` — or failed). Only pushes whose producer passed ``blocks``."""
        return self._consumer.take_staging_events()

    def stats(self) -> StatsSnapshot:
        return self._stats.snapshot(self._caches.wire_cached_bytes)

    @property
    def num_in_flight(self) -> int:
        return self._producer.num_held + self._consumer.num_pending

    def close(self) -> None:
        """Close the channel, every link and the data plane; join every thread started. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._channel.close()
        self._peers.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._link_opener.shutdown(wait=True, cancel_futures=True)
        self._data_plane.close()
        self._consumer.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- channel callbacks (dispatcher thread) ------------------------------------------
    def _on_message(self, sender: str, body: Message) -> Message | ReplyThen | None:
        log.debug("%s <- %s: %s", self.config.peer_id, sender, type(body).__name__)
        if isinstance(body, Handshake):
            try:
                return self._peers.on_handshake(sender, body)
            except HandshakeError:  # logged by on_handshake; the initiator gets it as the reply
                self._stats.record_refused_handshake()
                raise
        if isinstance(body, Announce):
            self._consumer.on_announce(sender, body)
            return None
        try:
            if isinstance(body, PullRequest):
                return self._producer.on_pull(sender, body)
            if isinstance(body, PushOffer):
                return self._consumer.on_push_offer(sender, body)
        except PeerResetError as err:  # expected after a loss or a restart: the peer shakes hands and asks again
            log.info("%s: %s", self.config.peer_id, err)
            return ErrorMsg.from_exception(err, body.request_id)
        if isinstance(body, Done):
            self._consumer.on_done(sender, body)
            return None
        if isinstance(body, ErrorMsg):
            self._consumer.on_error(sender, body)
            return None
        raise ProtocolError(f"unexpected {type(body).__name__} from {sender!r}")

    def _on_peer_lost(self, peer_id: str, error: PeerLostError) -> None:
        """A peer is gone, or (PeerResetError) what it held about us or we about it is: what was agreed with it
        before the loss goes (its handshake, links, the requests waiting for its tensors, what we hold for it);
        whatever was started with it after the loss (its ``loss_seq``) stays."""
        if parse_peer_id(peer_id) is not None:  # else a raw channel client, no engine rank: no request names it
            self._consumer.fail_peer(peer_id, error)  # first: once its link is closed (what it sees), they failed
            self._producer.peer_lost(peer_id, error)
        self._peers.drop(peer_id, error, before=error.loss_seq, at=error.address)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"engine {self.config.peer_id!r} is closed")


def _check_request_id(request_id: object) -> None:
    """What the protocol carries as a request id (a non-empty str of at most MAX_ID_CHARS, encodable as UTF-8):
    refused at the call, not when its first message is refused on the way out, after the request was taken."""
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= MAX_ID_CHARS:
        what = f"{len(request_id)} chars" if isinstance(request_id, str) else type(request_id).__name__
        raise ValueError(f"request id must be a str of 1-{MAX_ID_CHARS} chars, got {what}: {request_id!r:.80}")
    check_encodable_id("request id", request_id)


def _check_layer(request_id: str, layer: object) -> None:
    """A layer index as the protocol carries it: an int, not a bool (every span holds True, as layer 1) nor a
    numpy int (no Announce carries either)."""
    if not is_int(layer):
        raise ValueError(f"request {request_id!r}: layer must be an int (a global layer index), got {layer!r}")


def _check_num_tokens(request_id: str, num_tokens: object, what: str = "num_tokens") -> None:
    if not (is_int(num_tokens) and num_tokens >= 1):  # type: ignore[operator]
        raise ValueError(f"request {request_id!r}: {what} must be an int >= 1, got {num_tokens!r}")


def _check_hold(request_id: str, hold: object, push: bool = False) -> None:
    """A hold number (``finish``, ``expect``, ``decline``): an int in [0, 2**63), 0 for a push (not held)."""
    if not (is_int(hold) and 0 <= hold <= MAX_HOLD):  # type: ignore[operator]
        raise ValueError(f"request {request_id!r}: hold must be an int in [0, 2**63) (0: not named), got {hold!r}")
    if push and hold:
        raise ValueError(f"request {request_id!r}: hold={hold} names a hold for pulling; a push has none")


def _wait_timeout(timeout_s: object) -> float:
    """A wait's ``timeout_s``: 0 (only look) or what :func:`check_timeout` takes, which names any other value
    (nan never expired, a negative one timed out at once, inf raised OverflowError in the wait)."""
    if isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s == 0:
        return 0.0
    return check_timeout("timeout_s", timeout_s)
