"""One direction of a link: ops posted in call order, a bounded number in flight, completed in order.

The futures of posted ops complete in call order. An op whose
``before_send`` hook raises is never posted: its future fails at once,
possibly ahead of earlier ops (see :meth:`Pipe._run_hook`). When the link
breaks or closes, every pending op fails. Futures are settled with no lock
of the pipe held, so their done-callbacks may call back into the link
(stats, send) or take locks of their own. The posting gate may be held
(a failed hook or post settles on the posting thread): a callback must not
wait for the link's threads.

A pipe owns two threads. The poster takes queued ops in order, runs an op's
``before_send`` hook and posts it to the backend without waiting for earlier
ops to finish, up to ``max_in_flight`` ops and ``max_in_flight_bytes`` bytes
outstanding (one op always goes, however large). Many posted operations keep
the wire busy; one blocking send after another does not, and gloo in
particular writes a send's payload only once the peer's receive is posted, so
a shallow receive window costs a round trip per tensor. The byte bound keeps
the last posted op's deadline (counted from its posting) meaningful. The reaper waits for
the oldest posted op, with that op's deadline, and completes futures in order.
``on_idle(full)`` runs on the poster each time it is about to wait (``full``:
ops are queued but the window is full) and says how long that wait may
last before it runs again; framed links flush their headers there. Both
threads end when the pipe is stopped; :meth:`Pipe.join` waits for them.

:meth:`Pipe.post_queued` lets the submitting thread post in the poster's
place (the link uses it for sends, and for receives on links without frame
headers): ops without a hook that fit the window go out at once, without
waking the poster. On two busy cores a woken poster waited 0.2-2 ms for a core
(measured, bench_overlap's analysis), and that wait sat on every message's
critical path. A gate (a plain lock) keeps one thread posting at a time, so
call order is post order whoever posts; a thread that finds the gate taken
leaves its ops to the poster and wakes it. Wake-ups are counted: one that
comes while the poster is between its last look and its sleep (a caller
that posted in its place and left a frame header for it to flush) makes it
look again instead of sleeping until the next send, which is how a stream's
last header once waited forever (bench overlap, a receiver's 60 s timeout). The two threads wait on separate
conditions of one lock, so a post wakes only the reaper and a completion
only a poster that waits for room.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import ClosedError, NcclKVError, TransferError

__all__ = ["MIN_WAIT_S", "Completed", "HookResultRefused", "Op", "Pending", "Pipe", "settle"]

_log = logging.getLogger(__name__)
MIN_WAIT_S = 0.001  # backends read a zero timeout as "no timeout"


class Pending(Protocol):
    """A posted backend operation."""

    def wait(self, timeout_s: float) -> None:
        """Block until done; raise on backend failure or when ``timeout_s`` passes."""


class Completed:
    """A pending op that is already done (empty tensors never touch the backend)."""

    def wait(self, timeout_s: float) -> None:
        return None


@dataclass(slots=True, eq=False)
class Op:
    """One send or receive on its way through a pipe."""

    label: str  # "link 'x' send seq 3 shape (2, 4) torch.float16": the prefix of every error
    tensor: torch.Tensor
    future: Future[Any]
    timeout_s: float
    ready_event: object | None = None
    before_send: Callable[[], torch.Tensor | None] | None = None  # may return the tensor to post instead
    fill: Callable[[torch.Tensor], None] | None = None  # writes the tensor; the backend's post runs it (Link._post)
    ahead: bool = False  # taken ahead of its turn (Pipe.prepare_ahead): its hook ran
    described: bool = False  # its header went out ahead of its turn (Link._describe_ahead)
    pending: Pending | None = None
    deadline: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class HookResultRefused(Exception):
    """Raised by a ``before_send`` wrapper whose hook returned a tensor that cannot be posted.

    The hook returned, so it may have told the peer of the tensor (the
    producer's hook announces it): unlike a hook that raised, its send cannot
    just be skipped, since the peer's receive for it would take the next
    tensor. The pipe breaks the link with ``error``.
    """

    def __init__(self, error: NcclKVError) -> None:
        super().__init__(str(error))
        self.error = error


def settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> bool:
    """Complete ``future`` unless it already is; return whether this call completed it.

    Its done-callbacks run here: call it with no lock held that they might need.
    """
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        return False
    return True


class Pipe:
    """Ordered, bounded, asynchronous execution of one direction's ops."""

    def __init__(
        self,
        name: str,
        post: Callable[[Op], Pending],
        finish: Callable[[Op], None],
        fail: Callable[[Op, BaseException], None],
        max_in_flight: int,
        max_in_flight_bytes: int,
        on_idle: Callable[[bool], float | None] | None = None,
    ) -> None:
        if max_in_flight < 1 or max_in_flight_bytes < 1:
            raise ValueError(f"max_in_flight and max_in_flight_bytes must be >= 1, got {max_in_flight}, {max_in_flight_bytes}")
        self._post = post
        self._on_idle = on_idle
        self._finish = finish
        self._fail = fail
        self._max_in_flight = max_in_flight
        self._max_in_flight_bytes = max_in_flight_bytes
        self._bytes_in_flight = 0
        self._lock = threading.Lock()
        self._posting = threading.Condition(self._lock)  # the poster (and wait_drained) waits here
        self._reaping = threading.Condition(self._lock)  # the reaper waits here
        self._gate = threading.Lock()  # held by whichever thread posts to the backend or runs on_idle
        self._kicks = 0  # wake-ups asked of the poster; one that comes before it waits must not be lost
        self._queued: deque[Op] = deque()
        self._in_flight: deque[Op] = deque()
        self._stopping = False
        self._threads = (
            threading.Thread(target=self._post_loop, name=f"{name}-post", daemon=True),
            threading.Thread(target=self._reap_loop, name=f"{name}-reap", daemon=True),
        )
        for thread in self._threads:
            thread.start()

    def submit(self, op: Op, *, wake: bool = True) -> None:
        """Queue ``op``; ``wake=False``: the caller follows with :meth:`post_queued`, which wakes the poster if needed."""
        with self._lock:
            if self._stopping:
                raise ClosedError(f"{op.label}: the link is closed")
            self._queued.append(op)
            if wake:
                self._posting.notify()

    def post_queued(self, hooked: int = 0) -> None:
        """Post, on the calling thread, the queued ops that need no hook and fit the window.

        ``hooked``: up to that many ops with a hook or a fill go too, theirs
        run here (a caller with nothing else to do, the end of a forward,
        saves the poster's wake-up on the last layer's path). Whatever it
        leaves (more such ops, a full window, another thread posting, headers
        due later) is the poster's, which it wakes. Errors go to the ops'
        futures, never to the caller.
        """
        if not self._gate.acquire(blocking=False):
            self._wake_poster()
            return
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    if not self._queued:
                        break
                    op = self._queued[0]
                    needs_poster = op.before_send is not None or op.fill is not None
                    if (needs_poster and hooked < 1) or not self._has_room(op):
                        # A kick, not a bare notify: the poster may be between its idle turn and its wait,
                        # and a header held for the op just posted (its predecessor in flight) would then
                        # wait for the window this op needs, which waits for that header.
                        self._kicks += 1
                        self._posting.notify()
                        return
                    hooked -= needs_poster
                    self._queued.popleft()
                if not self._post_one(op):
                    return
            if self._idle(False) is not None:  # a header waits for its grace period: the poster flushes it
                self._wake_poster()
        finally:
            self._gate.release()

    def prepare_ahead(self, describe: bool, max_ops: int, max_bytes: int) -> list[Op]:
        """Take queued ops ahead of their turn: run their hooks now and, with ``describe``, mark them
        described; return them in queue order.

        Only a run of ops at the head of the queue not taken ahead yet,
        each with a fill and bytes, at most ``max_ops`` of them holding at
        most ``max_bytes`` in all, the first whatever its size (their hooks
        take wire buffers). None while the head was taken ahead (a run taken
        earlier is still being posted): an empty list. Their hooks (the producer's
        take-and-announce) run here, before the current op's fill, so the
        peer hears of them, and posts their receives, while this op is filled
        and on the wire. A hook that raises skips its op as at its turn (nobody
        was told of it) and ends the run; one whose result is refused breaks
        the link (see :meth:`_run_hook`). Only the gate holder calls it (from
        its post), and only gate holders take ops off the queue, so the run
        stays at the head until it is posted.
        """
        taken: list[Op] = []
        nbytes = 0
        while len(taken) < max_ops:
            with self._lock:
                op = self._queued[len(taken)] if len(self._queued) > len(taken) else None
            if op is None or op.fill is None or op.ahead or op.nbytes == 0:  # an empty send waits for its own
                break
            if taken and nbytes + op.nbytes > max_bytes:
                break
            if op.before_send is not None:
                ran = self._run_hook(op)
                op.before_send = None  # ran: not again at its turn
                if not ran:
                    with self._lock:
                        if op in self._queued:  # else stopped meanwhile: stop() handed it to the closer
                            self._queued.remove(op)
                    break
            op.ahead, op.described = True, describe
            taken.append(op)
            nbytes += op.nbytes
        return taken

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def stop(self) -> list[Op]:
        """Stop both threads; return the ops not yet completed, oldest first, for the caller to fail."""
        with self._lock:
            self._stopping = True
            ops = [*self._in_flight, *self._queued]
            self._in_flight.clear()
            self._bytes_in_flight = 0
            self._queued.clear()
            self._posting.notify_all()
            self._reaping.notify_all()
        return ops

    def wait_drained(self, deadline: float) -> bool:
        """Wait until no op is in flight (the pipe stopped, or ``deadline`` passed: False)."""
        with self._lock:
            while self._in_flight and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._posting.wait(left)
            return not self._in_flight

    def join(self, timeout_s: float) -> bool:
        """Wait for both threads to end; return False if one is still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() and t is not threading.current_thread() for t in self._threads)

    def _wake_poster(self) -> None:
        with self._lock:
            self._kicks += 1
            self._posting.notify()

    def _ready(self) -> bool:
        """Whether the poster has something to do; called with the lock held."""
        return self._stopping or bool(self._queued and self._has_room(self._queued[0]))

    def _post_loop(self) -> None:
        while True:
            with self._gate:
                with self._lock:
                    if self._stopping:
                        return
                    full = bool(self._queued)
                    op = self._queued.popleft() if self._ready() else None  # only gate holders take ops
                    kicks = self._kicks
                if op is not None:
                    self._post_one(op)
                    continue
                pause = self._idle(full)  # may post to the backend: under the gate, outside the lock
            # A thread that posted in our place between our idle call and this wait (it left a header
            # for us to flush after its grace period) kicked us: look again instead of sleeping, or the
            # header, and with it the peer's receives, would wait for the next send.
            with self._lock:
                if not self._ready() and self._kicks == kicks:
                    self._posting.wait(pause)

    def _post_one(self, op: Op) -> bool:
        """Run the hook, post ``op`` and hand it to the reaper; with the gate held. False: the pipe stopped."""
        if op.before_send is not None and not self._run_hook(op):
            return True
        op.deadline = time.monotonic() + op.timeout_s  # before posting: a framed receive waits for its header
        try:
            op.pending = self._post(op)
        except Exception as exc:  # the backend refused, or the peer's header did not match: the link is unusable
            self._fail(op, exc)
            return True
        with self._lock:
            stopped = self._stopping  # stopped while posting: stop() did not see this op
            if not stopped:
                self._in_flight.append(op)
                self._bytes_in_flight += op.nbytes
                self._reaping.notify()
        if stopped:  # failed after the lock: its callbacks may call into the link (stats, send)
            # Through fail, not settled here: the link knows whether it broke (the cause) or was closed.
            self._fail(op, ClosedError(f"{op.label}: the link is closed"))
        return not stopped

    def _idle(self, full: bool) -> float | None:
        """Run ``on_idle`` (with the gate held) before the poster waits: it returns how long to wait at most.

        Its failure fails the oldest op in flight (and so the link).
        """
        if self._on_idle is None:
            return None
        try:
            return self._on_idle(full)
        except Exception as exc:
            with self._lock:
                oldest = self._in_flight[0] if self._in_flight else None
            if oldest is not None:
                self._fail(oldest, exc)
            else:
                _log.warning("on_idle failed with nothing in flight: %r", exc)
            return None

    def _has_room(self, op: Op) -> bool:
        """Whether ``op`` may be posted now; called with the lock held."""
        if not self._in_flight:
            return True
        return len(self._in_flight) < self._max_in_flight and self._bytes_in_flight + op.nbytes <= self._max_in_flight_bytes

    def _run_hook(self, op: Op) -> bool:
        """Run ``op``'s hook; False: the op is not to be posted (its future is settled, or the link broke).

        A hook that raises told nobody of its tensor (the producer announces
        only once it holds the buffer, and the hook runs before the op is
        described, see prepare_ahead): skip the op; nothing was posted, so the
        stream stays in step. Its error keeps its type when it is ours
        (CapacityError, ShapeMismatchError), else it is a TransferError. A
        hook that returned a tensor that cannot be posted may have announced
        it: the link breaks (``fail``), as for a failed fill. An op queued
        with a meta placeholder posts what its hook returns (checked by
        Link.send's wrapper, which raises HookResultRefused).
        """
        assert op.before_send is not None
        try:
            sent = op.before_send()
        except HookResultRefused as refused:
            self._fail(op, refused.error)
            return False
        except Exception as exc:
            settle(op.future, error=_not_sent(op, exc))
            _log.warning("%s: before_send failed: %s", op.label, _text(exc))
            return False
        if op.tensor.device.type == "meta":
            if not isinstance(sent, torch.Tensor) or sent.device.type == "meta":
                what = f"a meta tensor {tuple(sent.shape)}" if isinstance(sent, torch.Tensor) else type(sent).__name__
                self._fail(op, TransferError(f"before_send returned {what} for the placeholder "
                                             f"{tuple(op.tensor.shape)} {op.tensor.dtype}"))
                return False
            op.tensor = sent
        return True

    def _reap_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._in_flight:
                    self._reaping.wait()
                if not self._in_flight:
                    return
                op = self._in_flight[0]
            assert op.pending is not None
            try:
                op.pending.wait(max(MIN_WAIT_S, op.deadline - time.monotonic()))
            except Exception as exc:
                self._fail(op, exc)
                continue
            with self._lock:
                if not self._in_flight or self._in_flight[0] is not op:
                    continue  # stopped meanwhile; stop() handed the op to the closer
                self._in_flight.popleft()
                self._bytes_in_flight -= op.nbytes
                if self._queued or not self._in_flight:  # a poster waiting for room, or wait_drained
                    self._posting.notify_all()
            self._finish(op)


def _not_sent(op: Op, exc: Exception) -> NcclKVError:
    """The error of an op whose hook raised: ours keep their type (a CapacityError stays one), others are
    TransferErrors."""
    text = f"{op.label}: before_send failed, not sent: {_text(exc)}"
    error = type(exc)(text) if isinstance(exc, NcclKVError) else TransferError(text)
    error.__cause__ = exc
    return error


def _text(exc: Exception) -> str:
    """``repr(exc)``, or its type's name when its text cannot be rendered: rendering it raised on the poster,
    which ended there, leaving that send and every later one unsettled."""
    try:
        return repr(exc)
    except Exception:  # noqa: BLE001 - a hook's error whose __repr__ (or __str__) raises
        return f"{type(exc).__name__} (its text could not be rendered)"
