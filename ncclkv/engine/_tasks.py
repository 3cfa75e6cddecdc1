"""Tasks on the engine's executors: one that raises is logged and handed to its owner, never lost.

``Executor.submit`` keeps a task's exception in a future; the engine starts its
tasks (offers, pulls, declines, link opens) and keeps no future, so an
exception that escaped a task's own handling would vanish with it: no log,
and the request it served never reported.

The tasks that wait on one remote peer (a consumer's pulls, a producer's push
offers: a handshake, then the request's answer, up to ``deadline_s`` each when
the peer is dead or stopped) run on :class:`PeerTasks`, in a lane per peer
(and per address it is reached at: a peer restarted elsewhere is another
life): one peer that does not answer holds the few threads of its lane, never
the other peers' transfers, nor those of its later life at another address.
Once one of them finds its peer lost (:func:`fail_fast`), the tasks queued
behind it for that peer fail at once instead of each waiting another
``deadline_s``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from .._peers import lost_there
from ..errors import ClosedError, PeerLostError, PeerResetError, TransferError, TransferTimeout

__all__ = ["PeerTasks", "fail_fast", "submit_task"]

log = logging.getLogger("ncclkv.engine")

_IDLE_S = 60.0  # a task thread with nothing to run for this long ends (the next busy peer starts one again)


def submit_task(executor: Executor, what: str, on_error: Callable[[BaseException], None] | None,
                fn: Callable[..., None], *args: Any, peer: Hashable | None = None,
                at: str | None = None) -> Future[None]:
    """Run ``fn(*args)`` on ``executor``; if it raises, log the error naming ``what`` and call ``on_error(error)``
    (the owner fails or records its request, once), on the thread that ran it.

    ``peer``: on a :class:`PeerTasks`, run it in that peer's lane (started after the peer's earlier tasks);
    ``at``: the address it reaches the peer at (see :meth:`PeerTasks.fail_queued`).
    A task the lane fails before it started (its peer found lost by an earlier task, :func:`fail_fast`; or
    the executor shut down: :class:`ClosedError`) never runs: ``on_error`` gets that error instead, logged in
    one line. Without ``peer``, a task cancelled by the executor's shutdown is neither logged nor reported.
    """
    if peer is not None and isinstance(executor, PeerTasks):
        future: Future[None] = executor.submit_to(peer, fn, *args, on_skip=partial(_skipped, what, on_error), at=at)
    else:
        future = executor.submit(fn, *args)
    future.add_done_callback(lambda done: _report(done, what, on_error))
    return future


def fail_fast(executor: Executor, peer: str, error: BaseException, alive: Callable[[str], bool],
              at: str | None = None) -> int:
    """A task of ``peer``'s lane failed with ``error``: if it waited for a peer that did not answer (the channel
    reported the peer lost meanwhile: a :class:`PeerLostError` carrying its ``loss_seq``, but not a
    :class:`PeerResetError`, which a new handshake cures; or no reply within ``deadline_s``:
    :class:`TransferTimeout`) and the channel no longer hears the peer (``alive``), the tasks queued behind it
    for ``peer`` fail now with an error of the same type instead of each waiting ``deadline_s`` on it; how
    many. ``at``: the address the failed task reached the peer at; a task queued for another address (the peer
    restarted there) is for another life, and runs. A failure at once (a request naming a life of the peer id
    since replaced, a peer already lost) or a reply that carried an error (the peer is alive) fails no other
    task. Tasks submitted after this run as usual: a peer that comes back is used again."""
    if not isinstance(executor, PeerTasks) or not isinstance(error, (PeerLostError, TransferTimeout)):
        return 0
    if isinstance(error, PeerResetError) or (isinstance(error, PeerLostError) and error.loss_seq is None):
        return 0
    if alive(peer):
        return 0
    return executor.fail_queued(peer, _like(error, f"{peer!r} did not answer an earlier request: {error}"), at)


def _skipped(what: str, on_error: Callable[[BaseException], None] | None, reason: BaseException) -> None:
    """A task failed by its lane before it started: logged, and ``on_error`` told (never raises)."""
    error = _like(reason, f"{what} not started: {reason}")
    log.log(logging.INFO if isinstance(error, ClosedError) else logging.WARNING, "%s", error)
    _tell_owner(what, on_error, error)


def _like(error: BaseException, text: str) -> BaseException:
    """A new error of ``error``'s type saying ``text`` (each request its own: they are raised in many threads)."""
    try:
        copy = type(error)(text)
    except Exception:  # noqa: BLE001 - a type with another constructor
        copy = TransferError(text)
    if isinstance(error, PeerLostError) and isinstance(copy, PeerLostError):
        copy.stamped(error.loss_seq, error.address, error.incarnation)
    return copy


def _report(future: Future[None], what: str, on_error: Callable[[BaseException], None] | None) -> None:
    if future.cancelled():
        return
    error = future.exception()
    if error is None:
        return
    log.error("%s failed: %s: %s", what, type(error).__name__, error, exc_info=error)
    _tell_owner(what, on_error, error)


def _tell_owner(what: str, on_error: Callable[[BaseException], None] | None, error: BaseException) -> None:
    """``on_error(error)``, never raising: it runs as a done-callback (whose exception concurrent.futures would only
    log) or while a lane fails its other tasks too."""
    if on_error is None:
        return
    try:
        on_error(error)
    except Exception as err:  # noqa: BLE001 - see above
        log.error("%s: reporting its failure failed too: %s: %s", what, type(err).__name__, err, exc_info=err)


@dataclass(slots=True, eq=False)
class _Task:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    on_skip: Callable[[BaseException], None] | None
    future: Future[Any] = field(default_factory=Future)


class _PeerKey(NamedTuple):
    """A lane's key: the peer, and the address its tasks reach it at (None: not said)."""

    peer: Hashable
    at: str | None


@dataclass(slots=True, eq=False)
class _Lane:
    """One peer's tasks not started yet, oldest first, and how many of its tasks run."""

    key: Hashable
    queue: deque[_Task] = field(default_factory=deque)
    ready: bool = False  # waits in PeerTasks._ready for a thread
    running: int = 0  # its tasks running now (at most PeerTasks's per_peer)


class PeerTasks(Executor):
    """Tasks by remote peer: each peer's start in submission order, at most ``per_peer`` of them at once (its
    lane; one per address the tasks reach the peer at, see :meth:`submit_to`); different peers' at once, on
    threads shared by every lane.

    A lane takes at most ``per_peer`` threads (1: its tasks run one after
    the other), so a peer that does not answer holds that many however many
    tasks wait for it, and the others' go on. Threads are started as lanes
    need them, at most ``max_workers`` (past it, lanes wait for one in the
    order they became ready, one task per turn), and end after ``idle_s``
    without work; each runs ``initializer(*initargs)`` first. :meth:`submit`
    (no peer) gives its task a lane of its own. ``shutdown(cancel_futures=True)``
    fails every task not started with :class:`ClosedError` (see
    :func:`submit_task`), as it does any task submitted after it.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "ncclkv-tasks",
                 initializer: Callable[..., object] | None = None, initargs: tuple[Any, ...] = (),
                 idle_s: float = _IDLE_S, per_peer: int = 1) -> None:
        if max_workers < 1 or per_peer < 1:
            raise ValueError(f"max_workers and per_peer must be at least 1, not {max_workers!r}, {per_peer!r}")
        self._max_workers = max_workers
        self._per_peer = per_peer
        self._prefix = thread_name_prefix
        self._initializer, self._initargs = initializer, initargs
        self._idle_s = idle_s
        self._cond = threading.Condition()
        self._lanes: dict[Hashable, _Lane] = {}  # the lanes with tasks queued or running, and only those
        self._ready: deque[_Lane] = deque()  # lanes with tasks queued that may run one more now, in turn
        self._threads: set[threading.Thread] = set()
        self._idle = 0  # threads waiting for a ready lane
        self._named = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` in a lane of its own (no peer): ``Executor.submit``."""
        return self._submit(object(), _Task(fn, args, kwargs, None))

    def submit_to(self, peer: Hashable, fn: Callable[..., Any], /, *args: Any,
                  on_skip: Callable[[BaseException], None] | None = None, at: str | None = None) -> Future[Any]:
        """Run ``fn(*args)`` in ``peer``'s lane, once its tasks submitted before started (and fewer than ``per_peer``
        of them run). If the lane fails it before it starts (:meth:`fail_queued`, or a shutdown that cancels), ``on_skip(error)`` is called instead, on the
        thread that failed it, and the future is cancelled. ``at``: the address it reaches ``peer`` at; each address
        of a peer has a lane of its own (another address is another life of the peer id, restarted there: its
        tasks must not wait behind those still waiting ``deadline_s`` on the dead one)."""
        return self._submit(_PeerKey(peer, at), _Task(fn, args, {}, on_skip))

    def fail_queued(self, peer: Hashable, error: BaseException, at: str | None = None) -> int:
        """Fail the tasks queued in ``peer``'s lane now (not those running) with ``error`` (``on_skip``);
        those submitted later run as usual. ``at``: only those that reach ``peer`` there or did not say where
        (one queued for another address stays queued). Returns how many."""
        tasks: list[_Task] = []
        with self._cond:
            for key, lane in list(self._lanes.items()):
                if not isinstance(key, _PeerKey) or key.peer != peer or not lost_there(at, key.at):
                    continue
                tasks += lane.queue
                lane.queue.clear()
                if lane.ready:
                    self._ready.remove(lane)
                    lane.ready = False
                if not lane.running:  # no thread on it: it ends here
                    del self._lanes[key]
        self._skip(tasks, error)
        return len(tasks)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more tasks (later ones fail with ClosedError). ``cancel_futures``: the tasks not started fail with
        ClosedError (else they still run); ``wait``: join every thread (running tasks end first)."""
        with self._cond:
            self._closed = True
            skipped: list[_Task] = []
            if cancel_futures:
                for key, lane in list(self._lanes.items()):
                    skipped += lane.queue
                    lane.queue.clear()
                    lane.ready = False
                    if not lane.running:
                        del self._lanes[key]
                self._ready.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        self._skip(skipped, ClosedError("the engine's tasks were shut down (the engine closes)"))
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    @property
    def num_threads(self) -> int:
        with self._cond:
            return len(self._threads)

    # -- internals ------------------------------------------------------------------------
    def _submit(self, key: Hashable, task: _Task) -> Future[Any]:
        with self._cond:
            if not self._closed:
                lane = self._lanes.get(key)
                if lane is None:
                    lane = self._lanes[key] = _Lane(key)
                lane.queue.append(task)
                self._schedule_locked(lane)
                return task.future
        self._skip([task], ClosedError("the engine's tasks were shut down (the engine closes)"))
        return task.future

    def _schedule_locked(self, lane: _Lane, wake: bool = True) -> None:
        """Under the lock: ``lane`` waits for a thread if it has tasks queued and may run one more; ``wake``: find
        it one (not when the caller is a thread about to take a ready lane itself)."""
        if lane.queue and not lane.ready and lane.running < self._per_peer:
            lane.ready = True
            self._ready.append(lane)
            if wake:
                self._wake_locked()

    def _wake_locked(self) -> None:
        """Under the lock, a lane just became ready: wake an idle thread for it, or start one if none is idle
        and fewer than ``max_workers`` run; else it waits its turn."""
        if self._idle >= len(self._ready):  # a thread woken but not yet running still counts as idle: not twice
            self._cond.notify()
            return
        if len(self._threads) >= self._max_workers:
            return
        thread = threading.Thread(target=self._work, name=f"{self._prefix}_{self._named}", daemon=True)
        self._named += 1
        self._threads.add(thread)
        try:
            thread.start()  # it waits for this lock before it looks for a lane
        except BaseException:
            self._threads.discard(thread)
            raise

    def _work(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer(*self._initargs)
            except Exception as err:  # noqa: BLE001 - the tasks still run, on the thread's inherited CPUs
                log.error("%s: thread initializer failed: %s: %s", threading.current_thread().name,
                          type(err).__name__, err)
        me = threading.current_thread()
        lane: _Lane | None = None
        while True:
            with self._cond:
                if lane is not None:  # its task ran: to the back of the line with the rest, or it ends
                    lane.running -= 1
                    if lane.queue:
                        self._schedule_locked(lane, wake=False)  # this thread takes a ready lane next
                    elif not lane.running and self._lanes.get(lane.key) is lane:
                        del self._lanes[lane.key]
                    lane = None
                while not self._ready:
                    if self._closed:
                        self._threads.discard(me)
                        return
                    self._idle += 1
                    try:
                        woken = self._cond.wait(self._idle_s)
                    finally:
                        self._idle -= 1
                    if not woken and not self._ready and not self._closed:  # idle for idle_s: end
                        self._threads.discard(me)
                        return
                lane = self._ready.popleft()
                lane.ready = False
                lane.running += 1
                task = lane.queue.popleft()
                self._schedule_locked(lane)  # it may run another of its tasks at once (per_peer)
            _run(task)

    @staticmethod
    def _skip(tasks: list[_Task], error: BaseException) -> None:
        for task in tasks:
            if task.future.done():  # cancelled by its owner
                continue
            if task.on_skip is not None:
                try:
                    task.on_skip(error)
                except Exception as err:  # noqa: BLE001 - the other tasks are failed too
                    log.error("failing a task not started failed: %s: %s", type(err).__name__, err, exc_info=err)
            task.future.cancel()


def _run(task: _Task) -> None:
    if not task.future.set_running_or_notify_cancel():
        return
    try:
        result = task.fn(*task.args, **task.kwargs)
    except BaseException as err:  # noqa: BLE001 - kept in the future, as concurrent.futures does
        task.future.set_exception(err)
    else:
        task.future.set_result(result)
