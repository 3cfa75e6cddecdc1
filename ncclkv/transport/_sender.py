"""gloo sends posted in order from a thread of their own.

gloo writes a send's payload on the thread that posts it when the peer's
receive is already posted: a ``ProcessGroupGloo.send`` of 1 MiB returned after
170-230 us here, the whole write to the socket. The link's poster thread posts
a send and then gathers the next tensor (the producer's fill), so with the
write on it the two ran one after the other, and one thread's gather plus
write bounded an engine's throughput. Posted from this thread, the write of
one tensor overlaps the gather of the next. Only CPU links use it: an NCCL
send is queued on a CUDA stream and returns at once, and must be posted under
the link's stream, which this thread does not hold.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from ..errors import TransferError
from ._pipe import MIN_WAIT_S, Pending

__all__ = ["DeferredSend", "SendThread"]

_ABORTED = "the link was aborted before this send was posted"


class DeferredSend:
    """A send queued for the :class:`SendThread`; :meth:`wait` covers its posting and its completion."""

    __slots__ = ("_posted", "_pending", "_error")

    def __init__(self) -> None:
        self._posted = threading.Event()
        self._pending: Pending | None = None
        self._error: BaseException | None = None

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        if not self._posted.wait(timeout_s):
            raise TimeoutError(f"send not posted within {timeout_s:g} s")
        if self._error is not None:
            raise self._error
        assert self._pending is not None
        self._pending.wait(max(MIN_WAIT_S, deadline - time.monotonic()))

    def _settle(self, pending: Pending | None, error: BaseException | None) -> None:
        self._pending, self._error = pending, error
        self._posted.set()


class SendThread:
    """Posts queued sends with ``post`` in submission order; :meth:`stop` fails those not yet posted.

    A post that raises fails its send and every later one, unposted: the peer was told of it (its
    frame header), so the next tensor on the wire would land in its receive (see ``_pipe``, where a
    failed post breaks the link at once)."""

    def __init__(self, name: str, post: Callable[[torch.Tensor], Pending]) -> None:
        self._post = post
        self._queue: queue.SimpleQueue[tuple[torch.Tensor, DeferredSend] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._failed: str | None = None  # why nothing more is posted: stopped, or a post failed
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, tensor: torch.Tensor) -> DeferredSend:
        pending = DeferredSend()
        with self._lock:  # checked and queued at once: stop() cannot come between
            failed = self._failed
            if failed is None:
                self._queue.put((tensor, pending))
                return pending
        pending._settle(None, TransferError(failed))
        return pending

    def stop(self) -> None:
        """No more posting: what is queued fails, the thread ends. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._failed = self._failed or _ABORTED
        self._queue.put(None)

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            tensor, pending = item
            with self._lock:
                failed = self._failed
            if failed is not None:  # aborted, or an earlier post failed: nothing more may go out
                pending._settle(None, TransferError(failed))
                continue
            try:
                posted = self._post(tensor)
            except Exception as exc:  # handed to the waiter (the link's reaper), which breaks the link
                # The peer was told of this send (its frame header) and expects it next: a later send
                # would land in this one's receive. Refuse every later one until the link breaks.
                with self._lock:
                    self._failed = self._failed or f"an earlier send's post failed ({exc!r}); not posted"
                pending._settle(None, exc)
            else:
                pending._settle(posted, None)
