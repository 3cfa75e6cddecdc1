"""State shared by a :class:`ncclkv.channel.Channel`'s threads: peer liveness (under one lock), counters,
and the token buckets that bound what a flood of bad frames can cost (log lines, error replies)."""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from .errors import DuplicatePeerIdError, PeerAuthError, PeerClosedError, PeerLostError, PeerResetError

__all__ = ["Budget", "Counters", "LossKind", "PeerTable", "loss_error", "lost_there"]

MAX_LOST_PEERS = 4096  # lost peers remembered (to raise PeerLostError, not "unknown"); oldest forgotten first

# How a peer was lost: it went silent or unreachable ("lost"), said Bye ("closed"), what it held about us, or we
# about it, is gone while it is there ("reset": it declared us lost, restarted, or moved to another address), or it
# cannot authenticate with us, for certain ("auth": a refused handshake, keys or secrets that differ), or it refuses
# us because another live process under our peer id replaced us there ("duplicate").
LossKind = Literal["lost", "closed", "reset", "auth", "duplicate"]
_LOSS_ERRORS: dict[str, type[PeerLostError]] = {"closed": PeerClosedError, "reset": PeerResetError,
                                                "auth": PeerAuthError, "duplicate": DuplicatePeerIdError}


def loss_error(kind: LossKind) -> type[PeerLostError]:
    """The error a loss of ``kind`` is reported with."""
    return _LOSS_ERRORS.get(kind, PeerLostError)


def lost_there(lost_at: str | None, reached_at: str | None) -> bool:
    """Whether a loss of the life at ``lost_at`` (``PeerLostError.address``) ends what reached the peer id at
    ``reached_at``: the same address, or either not known (None: the peer only reached us, or not said). What
    went to another address is another life's (the peer restarted there)."""
    return lost_at is None or reached_at is None or reached_at == lost_at


@dataclass(slots=True)
class Counters:
    """Frame counters (heartbeats excluded); each field is written by one thread only."""

    sent: int = 0
    received: int = 0
    rejected: int = 0
    late_replies: int = 0
    peers_lost: int = 0
    handler_errors: int = 0
    auth_failures: int = 0  # frames dropped for a bad/missing MAC or a replay (I/O thread)
    stale_resets: int = 0  # Resets ignored: they named another life of our peer id (I/O thread)


@dataclass(slots=True)
class Budget:
    """A token bucket: up to ``burst`` events at once, refilled at ``per_s``; one thread only."""

    per_s: float
    burst: float
    tokens: float = field(init=False)
    stamp: float | None = field(default=None, init=False)  # time of the last take
    refused: int = field(default=0, init=False)  # takes refused since the last granted one

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self, now: float) -> bool:
        if self.stamp is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.per_s)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.refused += 1
        return False

    def take_refused(self) -> int:
        """The count of refused takes since the last call, reset to 0."""
        refused, self.refused = self.refused, 0
        return refused


_REPLACED_KEPT = 8  # replaced incarnations remembered per peer id


@dataclass(slots=True)
class _PeerState:
    last_heard: float  # the channel clock (ncclkv._clock) at the last frame from the peer, or at connect()
    last_echo: float  # the same clock at the last echo of our heartbeats from it, or when it became known
    lost: bool = False
    lost_why: str = ""  # why it was lost (set with ``lost``), for calls that find it so
    lost_kind: LossKind = "lost"  # how (set with ``lost``): the error those calls raise
    rtt_s: float | None = None
    incarnation: int = 0  # the peer's channel incarnation, from its frames (0: none heard yet, or a raw client)
    # Incarnations this one replaced (the last few): one of them heard again, earlier than this one, is a late
    # frame of a dead life or a second process under the peer id, never a restart (see replaced_life).
    replaced: tuple[int, ...] = ()
    # The control address this life's handshake named, heard on our ROUTER while we had no DEALER to it: where a
    # peer that only reached us is ("": not said). Gone with the life (another incarnation, a new path); kept
    # once it is lost, until the peer id is connected again or another life is heard (the life a loss is of, and
    # where it was), and when that life is heard again (a life has one address).
    said_at: str = ""
    # The lives among ``replaced`` that connect() moved the peer id away from, with the address each was at: a
    # move back to that address takes the life there as it is again (it may be the one alive: a wrong address).
    moved_from: tuple[tuple[int, str], ...] = ()
    # The lives among ``replaced`` a move back took as they are again: not refused while no life is heard at the
    # address; once one is, they are lives it replaced again (one of them is the one heard, or restarted there).
    taken_back: tuple[int, ...] = ()
    # The clock when ``incarnation`` replaced the life before it (None: it replaced none); kept over a loss, as
    # ``replaced`` is: how long a replaced life heard again has been replaced (see replaced_for).
    replaced_at: float | None = None
    # First heard on our ROUTER after the life before it (another incarnation) was lost (or with no state: a peer
    # never known, or one forgotten once lost), with no connect() since:
    # the address connect() was last given is that lost life's, not where this one is (see came_after_loss). Kept
    # when this life is lost in turn and heard again.
    after_loss: bool = False


class PeerTable:
    """Which peers are known, alive or lost, and the message-id counter.

    A peer becomes known by :meth:`add` (an explicit connect) or :meth:`heard`
    (it sent us a valid frame). It is lost when :meth:`overdue` finds nothing
    heard from it for the deadline, or :meth:`mark_lost` is called; a lost peer
    stays listed (so sends to it raise :class:`PeerLostError`, not "unknown")
    until it is added or heard again. Each peer's incarnation is the one its
    frames carry: :meth:`heard` says when it changes (the peer id restarted).
    ``loss_seq`` counts the losses the channel reported (see
    :attr:`ncclkv.errors.PeerLostError.loss_seq`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, _PeerState] = {}
        self._lost: OrderedDict[str, None] = OrderedDict()  # lost peers, oldest first
        # From a random start: a peer may answer a late request of this channel's previous life (a process
        # restarted under the same id), and replies are matched by (msg id, sender) only.
        self._ids = itertools.count(secrets.randbits(48) + 1)
        self._loss_seq = 0

    def next_msg_id(self) -> int:
        with self._lock:
            return next(self._ids)

    @property
    def loss_seq(self) -> int:
        """How many losses were reported so far."""
        with self._lock:
            return self._loss_seq

    def next_loss_seq(self) -> int:
        """Count one more reported loss; return the new count (what its error carries)."""
        with self._lock:
            self._loss_seq += 1
            return self._loss_seq

    def add(self, peer_id: str, now: float) -> bool:
        """Start tracking ``peer_id`` from ``now``; False if it is already alive (nothing changes). A lost one keeps
        the lives it replaced and where those it was moved away from were, as when it is heard again (see
        :meth:`heard`): a connect() to it does not make a replaced life still running a restart."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is not None and not state.lost:
                return False
            self._states[peer_id] = _PeerState(
                last_heard=now, last_echo=now, moved_from=() if state is None else state.moved_from,
                replaced=() if state is None else state.replaced,
                replaced_at=None if state is None else state.replaced_at)
            self._lost.pop(peer_id, None)
            return True

    def heard(self, peer_id: str, now: float, incarnation: int = 0) -> int:
        """Record a valid frame from ``peer_id`` carrying ``incarnation`` (0: not given); an unknown or lost peer
        is alive from now.

        Returns the incarnation it had until this frame when this frame names another one (the peer id
        restarted: the caller reports the earlier one lost), else 0. The new incarnation is alive from now,
        echoes included."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is None or state.lost:
                # Where the lives it was moved away from were is kept: a move back there takes them (see renew).
                # So are the lives it replaced: a loss (of the live one, gone silent) does not make them restarts
                # (before, the replaced one of two processes under the id, heard next, was taken as the id's).
                # Another life heard now replaced the one lost too: that one (stopped, cut off) may run again.
                replaced, replaced_at = ((), None) if state is None else (state.replaced, state.replaced_at)
                if state is not None and state.incarnation and incarnation and incarnation != state.incarnation:
                    replaced, replaced_at = (*replaced, state.incarnation)[-_REPLACED_KEPT:], now
                # The life lost, heard again (its own life, or a frame naming none: another would have greeted first)
                # is where its handshake said (a life has one address): else connect() there took it for a move.
                again = bool(state is not None and state.incarnation and incarnation in (0, state.incarnation))
                heard_life, said_at = (state.incarnation, state.said_at) if again else (incarnation, "")
                # So did it come after the loss of the life before it, if it did (no connect() since: given_address),
                # or of one this table forgot (MAX_LOST_PEERS): the address connect() was given is not where it is.
                after_loss = (state.after_loss if again else
                              bool(state is None or (state.incarnation and incarnation)))
                self._states[peer_id] = _PeerState(
                    last_heard=now, last_echo=now, incarnation=heard_life, said_at=said_at,
                    moved_from=() if state is None else state.moved_from,
                    replaced=tuple(life for life in replaced if life != incarnation), replaced_at=replaced_at,
                    after_loss=after_loss)
                self._lost.pop(peer_id, None)
                return 0
            state.last_heard = max(state.last_heard, now)
            if not incarnation or incarnation == state.incarnation:
                return 0
            if incarnation in state.taken_back:  # the life a move back took: not one this one replaced
                state.replaced = tuple(life for life in state.replaced if life != incarnation)
            state.taken_back = ()
            replaced, state.incarnation = state.incarnation, incarnation
            if replaced:
                state.last_echo = max(state.last_echo, now)
                state.rtt_s = None
                state.replaced = (*state.replaced, replaced)[-_REPLACED_KEPT:]
                state.replaced_at = now
            state.said_at = ""  # the earlier life's: the new one is where its own handshake says
            return replaced

    def replaced_life(self, peer_id: str, incarnation: int, now: float, deadline_s: float) -> int | None:
        """The current incarnation of ``peer_id`` when ``incarnation`` is one it replaced, and earlier (incarnations
        grow with their channel's start time), or one it was moved away from (:meth:`renew`) and none is heard
        since (then 0); else None. Such a frame is a late one of a dead life, or comes from a second live process
        under the peer id (the earlier one, still running on its connection to us): taken as a restart, it would
        lose the live one (and the next frame of that one the other again). A smaller incarnation never heard is
        still a restart: it may be a later life on a host whose clock is behind. Also while the peer id is lost,
        if a later life was heard: the replaced one is no restart of it either, until that later life is gone as
        far as we can tell (it said Bye, or nothing of it was heard for more than ``deadline_s`` by ``now``): then
        the replaced one, still running, is the peer id's only process, and is taken again."""
        with self._lock:
            state = self._states.get(peer_id)
            if (state is None or not incarnation or incarnation not in state.replaced
                    or (state.incarnation and incarnation >= state.incarnation)
                    or (not state.incarnation and (state.lost or incarnation in state.taken_back))
                    or (state.lost and (state.lost_kind == "closed" or now - state.last_heard > deadline_s))):
                return None
            return state.incarnation

    def replaced_for(self, peer_id: str, now: float) -> float | None:
        """How long the live life of ``peer_id`` has replaced the one before it, by ``now``; None when the peer id
        is lost, unknown, or its life replaced none."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is None or state.lost or state.replaced_at is None:
                return None
            return now - state.replaced_at

    def renew(self, peer_id: str, now: float, moved_from: str = "", address: str = "") -> None:
        """Start ``peer_id`` over, alive from ``now`` with no incarnation known (connected at a new address:
        whoever answers there is taken as it is, not as a restart). The life it had (at ``moved_from``) is kept
        among those replaced: still running, it may go on sending on its own connection to us (see
        :meth:`replaced_life`); a life moved away from ``address`` earlier is no longer (moved back to it: the
        move away was wrong, and that life may be the one alive)."""
        with self._lock:
            old = self._states.get(peer_id)
            replaced, moved = ((), ()) if old is None else (old.replaced, old.moved_from)
            if old is not None and old.incarnation:
                replaced, moved = (*replaced, old.incarnation), (*moved, (old.incarnation, moved_from))
            back = {life for life, at in moved if at == address}
            # Those lives stay among the replaced (taken_back): a later life restarted there, heard first, still
            # replaced them, and their late frames are refused.
            replaced = replaced[-_REPLACED_KEPT:]
            # At most as many as lives are kept: one life moved from address to address gathers one each.
            moved = tuple((life, at) for life, at in moved if life in replaced and life not in back)[-_REPLACED_KEPT:]
            self._states[peer_id] = _PeerState(last_heard=now, last_echo=now, replaced=replaced, moved_from=moved,
                                               taken_back=tuple(life for life in replaced if life in back))
            self._lost.pop(peer_id, None)

    def forget_incarnation(self, peer_id: str) -> None:
        """The incarnation heard under ``peer_id`` was not its own (a client with another CURVE key): the next
        one heard is taken as it is."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is not None:
                state.incarnation, state.said_at = 0, ""

    def said(self, peer_id: str, incarnation: int, address: str) -> None:
        """A handshake of ``peer_id``'s life ``incarnation`` named ``address`` as its own, heard on our ROUTER while
        we have no DEALER to it; kept while that life is the one alive (see :meth:`said_at`)."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is not None and not state.lost and state.incarnation == incarnation:
                state.said_at = address

    def came_after_loss(self, peer_id: str) -> bool:
        """Whether the live life of ``peer_id`` was first heard (on our ROUTER: a lost peer has no DEALER) after the
        life before it, another incarnation, was lost, and connect() was not given an address for it since: the
        address connect() was given before is where the lost life was, not where this one is."""
        with self._lock:
            state = self._states.get(peer_id)
            return state is not None and not state.lost and state.after_loss

    def given_address(self, peer_id: str) -> None:
        """``connect()`` was given an address for ``peer_id``: that address counts again (see
        :meth:`came_after_loss`)."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is not None:
                state.after_loss = False

    def forget_said(self, peer_id: str) -> None:
        """``connect()`` moved ``peer_id`` elsewhere: where its life said it is no longer leads to it (before the
        I/O thread's switch renews the peer, a request would record the old address and go to the new one)."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is not None:
                state.said_at = ""

    def said_at(self, peer_id: str, *, lost_too: bool = False) -> str:
        """Where the live life of ``peer_id``, which only reached us, said it is (its handshake's control address);
        "" when none said so (the life lost last, heard again, still did). ``lost_too``: or the life lost last,
        until the peer id is connected again or another life is heard (where the life a loss is of was, as the
        address connect() was given is kept)."""
        with self._lock:
            state = self._states.get(peer_id)
            return "" if state is None or (state.lost and not lost_too) else state.said_at

    def incarnation(self, peer_id: str) -> int:
        """The incarnation last heard from ``peer_id``, lost or alive (0: none, or unknown peer)."""
        with self._lock:
            state = self._states.get(peer_id)
            return 0 if state is None else state.incarnation

    def echoed(self, peer_id: str, now: float) -> None:
        """Record the echo of one of our heartbeats from ``peer_id``: our path to it reaches it."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is not None and not state.lost:
                state.last_echo = max(state.last_echo, now)

    def require_alive(self, peer_id: str) -> None:
        """Raise ``ValueError`` for a peer never seen, :class:`PeerLostError` for a lost one."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is None:
                raise ValueError(
                    f"unknown peer {peer_id!r}: connect() to it first, or wait until it sends a message"
                )
            if state.lost:
                raise loss_error(state.lost_kind)(
                    f"peer {peer_id!r} is lost: {state.lost_why or 'nothing heard within the deadline'}")

    def loss(self, peer_id: str) -> tuple[str, LossKind]:
        """Why ``peer_id`` was lost, and how (see :meth:`mark_lost`); ``("", "lost")`` when it is not (or unknown)."""
        with self._lock:
            state = self._states.get(peer_id)
            return (state.lost_why, state.lost_kind) if state is not None and state.lost else ("", "lost")

    def overdue(self, now: float, deadline_s: float) -> list[tuple[str, str]]:
        """Mark lost, and return with the reason, the alive peers not heard from for more than ``deadline_s``,
        or whose echoes of our heartbeats stopped that long: what we send them no longer reaches them (a
        process that died without a Bye and came back under the same id keeps talking to us, while our
        frames still go to the dead one's address)."""
        with self._lock:
            late = []
            for peer_id, state in self._states.items():
                if state.lost:
                    continue
                if now - state.last_heard > deadline_s:
                    late.append((peer_id, f"nothing heard for more than deadline_s={deadline_s}s"))
                elif now - state.last_echo > deadline_s:
                    late.append((peer_id, f"none of our heartbeats echoed for more than deadline_s={deadline_s}s "
                                          "(what we send no longer reaches it: restarted under the same id?)"))
            for peer_id, why in late:
                self._set_lost(peer_id, why)
            return late

    def mark_lost(self, peer_id: str, why: str, kind: LossKind = "lost") -> bool:
        """Mark ``peer_id`` lost now, for reason ``why``; False if it was unknown or already lost. Calls that find
        it lost raise :func:`loss_error` of ``kind``."""
        with self._lock:
            state = self._states.get(peer_id)
            if state is None or state.lost:
                return False
            self._set_lost(peer_id, why, kind)
            return True

    def _set_lost(self, peer_id: str, why: str, kind: LossKind = "lost") -> None:
        """Under the lock: mark lost, and forget the oldest lost peers past :data:`MAX_LOST_PEERS`
        (a stream of peers that each say hello once must not grow the table forever)."""
        state = self._states[peer_id]
        state.lost, state.lost_why, state.lost_kind = True, why, kind
        self._lost[peer_id] = None
        while len(self._lost) > MAX_LOST_PEERS:
            oldest, _ = self._lost.popitem(last=False)
            del self._states[oldest]

    def set_rtt(self, peer_id: str, rtt_s: float) -> None:
        with self._lock:
            state = self._states.get(peer_id)
            if state is not None:
                state.rtt_s = rtt_s

    def alive(self, peer_id: str) -> bool:
        with self._lock:
            state = self._states.get(peer_id)
            return state is not None and not state.lost

    def rtt(self, peer_id: str) -> float | None:
        with self._lock:
            state = self._states.get(peer_id)
            return None if state is None else state.rtt_s
