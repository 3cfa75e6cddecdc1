"""In-process links for unit tests of the layers above the transport.

A loopback link is a real :class:`Link` (same ordering, deadlines, counters
and failure handling) over a wire in memory: the n-th send posted by one end
meets the n-th receive posted by the other, the bytes are copied, and both
complete. Like gloo and NCCL for large tensors, a send completes only when
the peer has posted the matching receive. Unlike them, a receive that does not
match the sent shape and dtype fails with :class:`ShapeMismatchError`.
CUDA tensors are copied once both posting streams reach their post, and the
copy is complete before either end completes, as a wait on NCCL work with a
timeout blocks the host until the bytes have landed.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from functools import partial

import torch

from .._env import env_settings
from ..errors import ShapeMismatchError, TransferError, TransferTimeout
from ._base import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_BYTES, check_link_args
from ._framing import Framing
from ._link import Link
from ._opener import LinkOpener

__all__ = ["LoopbackHub", "LoopbackTransport", "loopback_pair"]

_CANCEL_POLL_S = 0.05  # how often a rendezvous given a cancel event looks at it


class _WireOp:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        # What the posting stream queued before the post (a gather, a caller's writes) comes first.
        self.posted = torch.cuda.current_stream(tensor.device).record_event() if tensor.is_cuda else None
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"not matched by the peer within {timeout_s:g} s")
        if self.error is not None:
            raise self.error


class _Wire:
    """Both directions between two in-process ends; index = sending rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sends: tuple[deque[_WireOp], deque[_WireOp]] = (deque(), deque())
        self._recvs: tuple[deque[_WireOp], deque[_WireOp]] = (deque(), deque())
        self._closed_by: str | None = None

    def post(self, src: int, tensor: torch.Tensor, *, is_send: bool) -> _WireOp:
        op = _WireOp(tensor)
        with self._lock:
            if self._closed_by is not None:
                raise ConnectionError(f"loopback wire closed by {self._closed_by}")
            (self._sends if is_send else self._recvs)[src].append(op)
            self._match(src)
        return op

    def close(self, by: str) -> None:
        with self._lock:
            if self._closed_by is not None:
                return
            self._closed_by = by
            pending = [op for queues in (self._sends, self._recvs) for queue in queues for op in queue]
            for queue in (*self._sends, *self._recvs):
                queue.clear()
        for op in pending:
            op.error = ConnectionError(f"loopback wire closed by {by}")
            op.done.set()

    def _match(self, src: int) -> None:
        sends, recvs = self._sends[src], self._recvs[src]
        while sends and recvs:
            send, recv = sends.popleft(), recvs.popleft()
            a, b = send.tensor, recv.tensor
            if a.shape != b.shape or a.dtype != b.dtype:
                text = f"sent {tuple(a.shape)} {a.dtype}, receive posted for {tuple(b.shape)} {b.dtype}"
                send.error, recv.error = ShapeMismatchError(text), ShapeMismatchError(text)
            elif a.is_cuda or b.is_cuda:
                _copy_on_device(send, recv)
            else:
                b.copy_(a)
            send.done.set()
            recv.done.set()


def _copy_on_device(send: _WireOp, recv: _WireOp) -> None:
    device = (send.tensor if send.tensor.is_cuda else recv.tensor).device
    stream = torch.cuda.current_stream(device)
    for op in (send, recv):
        if op.posted is not None:
            stream.wait_event(op.posted)
    recv.tensor.copy_(send.tensor)
    stream.synchronize()


class _WireEnd:
    """The :class:`~ncclkv.transport._link.Backend` of one loopback end; ``headers``: a wire for frame headers."""

    name = "loopback"

    def __init__(self, wire: _Wire, link_rank: int, headers: _Wire | None = None) -> None:
        self._wire = wire
        self._rank = link_rank
        self._headers = headers

    def post_send(self, tensor: torch.Tensor) -> _WireOp:
        return self._wire.post(self._rank, tensor, is_send=True)

    def post_recv(self, tensor: torch.Tensor) -> _WireOp:
        return self._wire.post(1 - self._rank, tensor, is_send=False)

    def framing(self) -> Framing | None:
        if self._headers is None:
            return None  # the wire itself checks shape and dtype at matching
        return Framing(partial(self._headers.post, self._rank, is_send=True),
                       partial(self._headers.post, 1 - self._rank, is_send=False))

    def abort(self) -> None:
        self._wire.close(f"link rank {self._rank}")
        if self._headers is not None:
            self._headers.close(f"link rank {self._rank}")

    def release(self) -> None:
        return None


def loopback_pair(
    link_id: str,
    *,
    device: torch.device | str = "cpu",
    timeout_s: float | None = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
    framed: bool = False,
) -> tuple[Link, Link]:
    """Both ends (link rank 0, link rank 1) of an in-process link.

    ``framed``: send frame headers on a second wire, as gloo links do (see
    ``_framing``), so a mismatched receive is refused before it is posted.
    """
    timeout = env_settings().deadline_s if timeout_s is None else timeout_s
    dev = check_link_args(link_id, 0, device, timeout)
    wire, headers = _Wire(), _Wire() if framed else None
    ends = [
        Link(link_id, rank, dev, _WireEnd(wire, rank, headers), timeout_s=timeout, max_in_flight=max_in_flight,
             max_in_flight_bytes=max_in_flight_bytes, peer="loopback")
        for rank in (0, 1)
    ]
    return ends[0], ends[1]


class _Waiter:
    """The first end of a link at the hub, until the second comes (or refuses it: ``refused``)."""

    def __init__(self, link_rank: int) -> None:
        self.link_rank = link_rank
        self.wire = _Wire()
        self.refused: str | None = None


class LoopbackHub:
    """Where the :class:`LoopbackTransport` objects of one process (or one test) meet."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._counter = itertools.count()
        self._addresses: set[str] = set()
        self._waiting: dict[tuple[str, str], _Waiter] = {}
        self._used: set[tuple[str, str]] = set()

    def new_address(self) -> str:
        with self._cond:
            address = f"loopback:{next(self._counter) + 1}"
            self._addresses.add(address)
            return address

    def check(self, store_addr: str, link_id: str, link_rank: int) -> None:
        """Raise what :meth:`meet` would raise at once: an unknown address or a used link id."""
        with self._cond:
            self._check(store_addr, link_id, link_rank)

    def meet(self, store_addr: str, link_id: str, link_rank: int, deadline: float,
             cancel: threading.Event | None = None) -> _Wire:
        """Meet the other end by ``deadline``; or, once ``cancel`` is set, stop waiting (TransferError)."""
        key = (store_addr, link_id)
        where = f"link {link_id!r} (link rank {link_rank}, store {store_addr})"
        with self._cond:
            self._check(store_addr, link_id, link_rank)
            first = self._waiting.pop(key, None)
            if first is not None:
                self._used.add(key)
                if first.link_rank == link_rank:  # the waiting end fails too, at once, not at its deadline
                    first.refused = f"{where}: both ends claim link rank {link_rank}"
                self._cond.notify_all()
                if first.refused is not None:
                    raise ValueError(first.refused)
                return first.wire
            me = _Waiter(link_rank)
            self._waiting[key] = me
            while self._waiting.get(key) is me:
                left = deadline - time.monotonic()
                if left <= 0:
                    del self._waiting[key]
                    self._used.add(key)
                    raise TransferTimeout(f"{where}: peer (link rank {1 - link_rank}) did not join in time")
                if cancel is not None and cancel.is_set():
                    del self._waiting[key]
                    self._used.add(key)
                    raise TransferError(f"{where}: rendezvous cancelled before the peer (link rank {1 - link_rank}) "
                                        "joined")
                self._cond.wait(left if cancel is None else min(left, _CANCEL_POLL_S))
            if me.refused is not None:
                raise ValueError(me.refused)
            return me.wire

    def _check(self, store_addr: str, link_id: str, link_rank: int) -> None:
        where = f"link {link_id!r} (link rank {link_rank}, store {store_addr})"
        if store_addr not in self._addresses:
            raise TransferError(f"{where}: no loopback transport has that address")
        if (store_addr, link_id) in self._used:
            raise ValueError(f"{where}: link id already used; every link needs a new link_id")


class LoopbackTransport(LinkOpener):
    """A :class:`DataPlane` stand-in whose links are loopback links to another transport on the same hub."""

    kind = "loopback transport"

    def __init__(self, hub: LoopbackHub | None = None) -> None:
        self.hub = hub if hub is not None else LoopbackHub()
        super().__init__(self.hub.new_address())

    def _check_peer(self, link_id: str, link_rank: int, store_addr: str) -> None:
        self.hub.check(store_addr, link_id, link_rank)

    def _connect(self, link_id: str, link_rank: int, store_addr: str, device: torch.device, deadline: float,
                 op_timeout_s: float, cancel: threading.Event | None) -> _WireEnd:
        return _WireEnd(self.hub.meet(store_addr, link_id, link_rank, deadline, cancel), link_rank)
