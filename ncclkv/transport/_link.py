"""A link: ordered asynchronous send/recv between the two ranks of a 2-rank group.

NCCL point-to-point has no tags: the n-th send matches the n-th receive. A
link therefore keeps one ordered pipe per direction and uses tag 0 for
everything. The backend (gloo, NCCL or the in-process loopback) only posts
single operations; ordering, deadlines, counters and failure handling live
here, the same for all of them. A backend that offers frame headers (gloo)
gets each receive checked against the peer's header before it is posted
(``_framing``: gloo would end this process on a longer send).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Protocol

import torch

from .._timeout import check_timeout
from ..errors import ClosedError, NcclKVError, ProtocolError, ShapeMismatchError, TransferError, TransferTimeout
from ._base import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_BYTES, LinkStats, check_window
from ._framing import AHEAD_BYTES, BATCH, EARLY_FLUSH_BYTES, Framing, RecvFrames, SendFrames
from ._pipe import Completed, HookResultRefused, Op, Pending, Pipe, settle

__all__ = ["Backend", "Link"]

_log = logging.getLogger(__name__)
_JOIN_MARGIN_S = 2.0
_DEADLINE_SLACK_S = 0.02  # backends round their timeout down to whole milliseconds


class Backend(Protocol):
    """Posts single operations to the peer; knows nothing about order or deadlines."""

    @property
    def name(self) -> str: ...

    def post_send(self, tensor: torch.Tensor) -> Pending: ...

    def post_recv(self, tensor: torch.Tensor) -> Pending: ...

    def framing(self) -> Framing | None:
        """Where frame headers travel (see _framing); None: receives are posted unchecked (NCCL, plain loopback)."""

    def abort(self) -> None:
        """Make every posted operation fail soon, here and at the peer; never raises."""

    def release(self) -> None:
        """Drop the connection's resources; called once, after the link's threads ended."""


class Link:
    """One end of a link; see :class:`ncclkv.transport.LinkBase` for the contract.

    What breaks the link (the backend's stream of matched operations can
    no longer be trusted): a posted operation that fails or passes its
    deadline, a receive whose frame header does not match it, a ``fill``
    that raises, and a ``before_send`` hook whose returned tensor is refused
    (see :meth:`send`). That future fails with a typed error, every other
    pending future fails with :class:`TransferError`, and later calls raise
    :class:`ClosedError`. Open a new link (new id) to carry on. A
    ``before_send`` hook that raises fails its own send alone: nothing was
    posted or described. Future callbacks run on the link's threads or the
    caller's, with no lock of the link held: keep them short.
    """

    def __init__(
        self,
        link_id: str,
        link_rank: int,
        device: torch.device,
        backend: Backend,
        *,
        timeout_s: float,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        peer: str = "",
        on_close: Callable[[Link], None] | None = None,
    ) -> None:
        check_timeout("timeout_s", timeout_s)
        check_window(max_in_flight, max_in_flight_bytes)
        self._link_id = link_id
        self._link_rank = link_rank
        self._device = device
        self._backend = backend
        self._timeout_s = timeout_s
        self._peer = peer
        self._on_close = on_close
        self._lock = threading.Lock()
        self._closed = False
        self._released = False
        self._aborted = False
        self._broken: BaseException | None = None
        self._next_seq = [0, 0]  # send, recv
        self._tensors = [0, 0]
        self._bytes = [0, 0]
        framing = backend.framing()
        # Headers not yet known received describe sends in flight or described ahead: a ring past both.
        self._send_frames = SendFrames(framing, max_in_flight + BATCH + 2) if framing else None
        # Header receives posted as far ahead as the peer's send window reaches.
        self._recv_frames = RecvFrames(framing, max_in_flight) if framing else None
        # Which directions the caller's thread may post (see _pipe): sends, and receives
        # unless a receive must first wait for its frame header (gloo).
        self._inline = (True, self._recv_frames is None)
        self._stream = None
        if device.type == "cuda":  # the send waits on the producer's event on this stream, not on the host
            self._stream = torch.cuda.Stream(device=device)
        name = f"ncclkv-link-{link_id}"
        self._pipes = tuple(
            Pipe(f"{name}-{kind}", partial(self._post, d), partial(self._finish, d), self._fail, max_in_flight,
                 max_in_flight_bytes, on_idle=self._send_frames.idle if d == 0 and self._send_frames else None)
            for d, kind in enumerate(("send", "recv"))
        )

    @property
    def link_id(self) -> str:
        return self._link_id

    @property
    def link_rank(self) -> int:
        return self._link_rank

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backend_name(self) -> str:
        """One of "gloo", "nccl", "loopback"."""
        return self._backend.name

    @property
    def peer(self) -> str:
        """Where the peer was reached (store address), for messages."""
        return self._peer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> BaseException | None:
        """The error that broke the link, or None."""
        return self._broken

    def send(
        self,
        tensor: torch.Tensor,
        *,
        ready_event: object | None = None,
        before_send: Callable[[], torch.Tensor | None] | None = None,
        fill: Callable[[torch.Tensor], None] | None = None,
        timeout_s: float | None = None,
    ) -> Future[None]:
        """Queue ``tensor`` for sending; return at once.

        The send thread runs ``before_send()`` before posting, in send order
        (so what it emits is ordered like the data), then posts the send; a send without a
        hook that fits the window is posted on the calling thread instead, still
        in call order (see ``_pipe``). On CUDA the hook, the fill and the send run
        on the link's stream, the fill (or, without one, the hook) and the send
        after ``ready_event`` (default: an event recorded now on the caller's
        current stream); a hook with a fill does not wait for it (hooks run
        ahead: the next sends' compute would hold this one's fill). ``tensor`` must stay unmodified until the
        future completes. The deadline ``timeout_s`` (default: the link's)
        counts from the moment the send is posted.

        ``tensor`` may be a ``meta`` tensor, its shape and dtype only, when
        ``before_send`` returns the tensor to send (same shape and dtype, on
        this link's device, contiguous): that buffer then exists only from the
        moment the send is posted, so a sender with many sends queued holds
        buffers for the window's sends alone. A hook that raises fails that
        send only: it is skipped, and its error keeps its type when it is an
        :class:`~ncclkv.errors.NcclKVError` (else :class:`TransferError`). A
        hook that returns anything else (another shape, dtype or device, not
        contiguous, not a tensor) breaks the link with a
        :class:`ShapeMismatchError` (:class:`TransferError` for a non-tensor)
        naming both: it returned, so it may have told the peer of the tensor
        (the producer's hook announces it), and the peer's receive for it
        would take the next tensor instead.

        ``fill(tensor)`` writes the payload (the producer's gather) after the
        hook, once the tensor's frame header is on its way (gloo), right
        before the tensor is posted: the peer checks the header and posts its
        receive while the payload is written, so the data goes out at once
        instead of waiting a round trip for the receive. The header has
        promised the tensor, so a fill that raises breaks the link (the
        stream could not stay in step). A send with a fill runs the hooks of
        the queued sends with a fill right after it (up to ``BATCH - 1``
        holding ``AHEAD_BYTES``) before its own fill, and sends their header with its
        own (see ``_describe_ahead``): the peer hears of the next tensors
        while this one is written and on the wire. A hook that raises then
        still fails its own send only (nothing was described yet), and a
        header describes the tensor its hook returned.
        """
        placeholder = isinstance(tensor, torch.Tensor) and tensor.device.type == "meta"
        self._check_tensor(tensor, "send", placeholder=placeholder)
        if placeholder:
            if before_send is None:
                raise ValueError(f"link {self._link_id!r}: a meta tensor {tuple(tensor.shape)} is a placeholder; "
                                 "before_send must return the tensor to send")
            before_send = self._materializing(tensor, before_send)
        if self._device.type == "cuda":
            if ready_event is None:
                ready_event = torch.cuda.current_stream(self._device).record_event()
            if before_send is not None:
                # With a fill, the hook only takes a buffer and announces it; the fill waits for ready_event.
                # Waiting here would hold this send's fill behind the next ones' compute (their hooks run ahead).
                before_send = self._hook_on_link_stream(before_send, None if fill is not None else ready_event)
        return self._submit(0, tensor, timeout_s, ready_event, before_send, fill)

    def _materializing(self, placeholder: torch.Tensor,
                       hook: Callable[[], torch.Tensor | None]) -> Callable[[], torch.Tensor]:
        # What the hook raises skips its send (Pipe._run_hook); what it returns was perhaps announced, so a
        # refused result is a HookResultRefused, which breaks the link.
        want = f"the placeholder is {tuple(placeholder.shape)} {placeholder.dtype} (link on {self._device})"

        def materialize() -> torch.Tensor:
            sent = hook()
            if not isinstance(sent, torch.Tensor):
                raise HookResultRefused(TransferError(f"before_send returned {type(sent).__name__}, not the tensor "
                                                      f"for the placeholder; {want}"))
            if (sent.shape != placeholder.shape or sent.dtype != placeholder.dtype or sent.device != self._device
                    or not sent.is_contiguous()):
                layout = "" if sent.is_contiguous() else ", not contiguous"
                raise HookResultRefused(ShapeMismatchError(
                    f"before_send returned {tuple(sent.shape)} {sent.dtype} on {sent.device}{layout}; {want}"))
            return sent
        return materialize

    def _hook_on_link_stream(self, hook: Callable[[], torch.Tensor | None],
                             ready_event: object | None) -> Callable[[], torch.Tensor | None]:
        # The hook runs on the link's own stream, so what it allocates and queues comes before the send there;
        # a hook that writes the tensor itself (no fill) waits for ``ready_event`` first.
        def on_link_stream() -> torch.Tensor | None:
            with self._on_link_stream(ready_event):
                return hook()
        return on_link_stream

    def recv(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
        timeout_s: float | None = None,
    ) -> Future[torch.Tensor]:
        """Queue a receive of the peer's next tensor (sized from its announcement); return at once.

        Receives are posted in call order, at most ``max_in_flight`` (and
        ``max_in_flight_bytes``) ahead: on the calling thread when the window
        has room, unless the link frames (gloo: a receive waits for its header
        on the link's receive thread). ``out`` (contiguous, this link's device, the
        given shape and dtype) is filled in place; otherwise a tensor is
        allocated. The sent tensor must have the same number of bytes: gloo
        aborts the process on a size mismatch and NCCL does not check.
        """
        shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ValueError(f"link {self._link_id!r}: negative receive shape {shape}")
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self._device)
        elif tuple(out.shape) != shape or out.dtype != dtype:
            raise ValueError(
                f"link {self._link_id!r}: out is {tuple(out.shape)} {out.dtype}, receive announced {shape} {dtype}"
            )
        self._check_tensor(out, "recv")
        ready_event = None
        if self._device.type == "cuda":  # do not overwrite ``out`` while the caller's stream still uses it
            ready_event = torch.cuda.current_stream(self._device).record_event()
        return self._submit(1, out, timeout_s, ready_event, None)

    def post_queued_sends(self, limit: int) -> None:
        """Post up to ``limit`` queued sends on the calling thread, hooks and fills included; return at once if
        another thread is posting.

        For a caller that would otherwise only wait: the producer's ``finish``
        after a request's last layer, whose sends then skip the wait for the
        link's poster thread to be scheduled (0.3-0.8 ms on two busy cores).
        The hook of the send after the last one posted may run here too (a
        send with a fill runs the next one's hook ahead, see :meth:`send`).
        """
        if not (isinstance(limit, int) and limit >= 0):
            raise ValueError(f"link {self._link_id!r}: limit must be an int >= 0, got {limit!r}")
        self._pipes[0].post_queued(hooked=limit)

    def stats(self) -> LinkStats:
        with self._lock:
            return LinkStats(
                link_id=self._link_id,
                tensors_sent=self._tensors[0],
                bytes_sent=self._bytes[0],
                tensors_received=self._tensors[1],
                bytes_received=self._bytes[1],
                next_send_seq=self._next_seq[0],
                next_recv_seq=self._next_seq[1],
                in_flight_sends=self._pipes[0].in_flight(),
                in_flight_recvs=self._pipes[1].in_flight(),
            )

    def close(self) -> None:
        """Fail pending futures with ClosedError, abort the backend, join the threads. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            was_open = not self._closed
            self._closed = True
        if was_open:
            for op in self._stop_pipes():
                settle(op.future, error=ClosedError(f"{op.label}: the link was closed"))
        self._abort_backend()
        join_by = time.monotonic() + self._timeout_s + _JOIN_MARGIN_S  # one bound for both pipes
        joined = all([pipe.join(max(0.0, join_by - time.monotonic())) for pipe in self._pipes])
        if joined:
            if self._recv_frames is not None:
                self._recv_frames.clear()
            self._backend.release()
        else:
            _log.warning("link %r: a thread did not end within %.3g s", self._link_id, self._timeout_s + _JOIN_MARGIN_S)
        if self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "broken" if self._broken else "closed" if self._closed else "open"
        return f"Link({self._link_id!r}, rank {self._link_rank}, {self._backend.name} on {self._device}, {state})"

    # -- internals ---------------------------------------------------------

    def _check_tensor(self, tensor: torch.Tensor, what: str, placeholder: bool = False) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"link {self._link_id!r}: {what} needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != self._device and not placeholder:
            raise ValueError(f"link {self._link_id!r}: {what} tensor on {tensor.device}, link on {self._device}")
        if not tensor.is_contiguous():
            raise ValueError(f"link {self._link_id!r}: {what} tensor {tuple(tensor.shape)} is not contiguous")

    def _submit(
        self,
        direction: int,
        tensor: torch.Tensor,
        timeout_s: float | None,
        ready_event: object | None,
        before_send: Callable[[], torch.Tensor | None] | None,
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> Future:
        if timeout_s is None:
            timeout = self._timeout_s  # checked when the link was made
        else:
            check_timeout(f"link {self._link_id!r}: timeout_s", timeout_s)
            timeout = timeout_s
        future: Future = Future()
        future.set_running_or_notify_cancel()  # a posted transfer cannot be cancelled
        with self._lock:  # seq order == queue order
            if self._closed:
                cause = f" (broken: {self._broken})" if self._broken else ""
                raise ClosedError(f"link {self._link_id!r} is closed{cause}")
            seq = self._next_seq[direction]
            self._next_seq[direction] += 1
            kind = "send" if direction == 0 else "recv"
            label = f"link {self._link_id!r} {kind} seq {seq} shape {tuple(tensor.shape)} {tensor.dtype}"
            op = Op(label, tensor, future, timeout, ready_event, before_send, fill)
            self._pipes[direction].submit(op, wake=not self._inline[direction])
        if self._inline[direction]:  # posted on this thread when it can be (see _pipe); after the lock: it may fail the link
            self._pipes[direction].post_queued()
        return future

    @contextlib.contextmanager
    def _on_link_stream(self, ready_event: object | None) -> Iterator[None]:
        if self._device.type == "cuda":
            with torch.cuda.stream(self._stream):
                if ready_event is not None:
                    self._stream.wait_event(ready_event)
                yield
        else:
            yield

    def _post(self, direction: int, op: Op) -> Pending:
        # Framed links (see _framing): a receive is posted only once the peer's
        # header says it matches, since gloo would end this process on a longer
        # send; a send is described in a header, flushed in batches or when the
        # send side runs idle (the pipe's gate holder). A tensor cannot land before its header, so
        # waiting for it covers both; an empty send waits for its header.
        if direction == 1 and self._recv_frames is not None:
            try:
                self._recv_frames.check_next(op.tensor, op.deadline, op.timeout_s)
            except (ShapeMismatchError, ProtocolError):
                # The receives posted before this one matched their headers: let
                # them land before the link breaks, so they fail with their own.
                self._pipes[1].wait_drained(op.deadline)
                raise
        framed_send = direction == 0 and self._send_frames is not None
        header: Pending | None = None
        if framed_send and op.fill is not None:  # the header first: the peer posts its receive while we fill
            header = self._describe_ahead(op)
        elif direction == 0 and op.fill is not None:  # no headers: the next sends' hooks (announcements) run ahead
            self._pipes[0].prepare_ahead(False, BATCH - 1, AHEAD_BYTES)
        data: Pending = Completed()
        with self._on_link_stream(op.ready_event):
            if op.fill is not None:
                try:
                    op.fill(op.tensor)
                except Exception as exc:
                    raise TransferError(f"fill failed after the tensor was described to the peer: {exc!r}") from exc
            if op.tensor.numel() > 0:  # else nothing to move; both sides know the shape
                post = self._backend.post_send if direction == 0 else self._backend.post_recv
                data = post(op.tensor)
        if framed_send and op.fill is None:  # described after the post, batched (see _framing)
            header = self._send_frames.add(op.tensor, urgent=not self._pipes[0].in_flight())
        return data if header is None else header

    def _describe_ahead(self, op: Op) -> Pending | None:
        """Send the frame header of ``op`` (a send with a fill) and of the queued ones after it, before the fill.

        The headers of the next sends go ahead of this one's payload: on one
        TCP stream they would otherwise reach the peer only after these bytes,
        and the peer's receive for the next one, hence gloo's go-ahead for its payload,
        a round trip later (a bubble per piece of a layer). Their hooks run
        first (``Pipe.prepare_ahead``): each header then describes the tensor
        its hook took, which is the tensor posted, and the producer's
        Announces go out now too, so the peer has both before these bytes.
        A run of up to ``BATCH - 1`` queued sends (holding at most
        ``AHEAD_BYTES``, the first whatever its size) is described at once, then posted without headers of
        their own: with a backlog (many requests pushed at once) that is one
        header message, and one wake-up of the peer's receive thread, per
        run instead of per tensor, and the peer posts the run's receives
        while the first is on the wire. At most two headers go out per post,
        and only ops next in line are described, so the header ring's reuse
        rule holds (see ``SendFrames``). Returns the header's pending for an
        empty ``op`` (which waits for it).
        """
        frames = self._send_frames
        assert frames is not None
        new = [] if op.described else [op.tensor]
        ahead = self._pipes[0].prepare_ahead(True, BATCH - len(new), AHEAD_BYTES)
        new.extend(o.tensor for o in ahead)
        if not new:
            return None
        empty = op.tensor.numel() == 0
        urgent = bool(ahead) or empty or op.nbytes >= EARLY_FLUSH_BYTES or not self._pipes[0].in_flight()
        if frames.pending + len(new) > BATCH:
            frames.flush()
        for tensor in new:
            frames.add(tensor, hold=True)
        header = frames.flush() if urgent or frames.due else None
        return header if empty else None

    def _finish(self, direction: int, op: Op) -> None:
        with self._lock:
            self._tensors[direction] += 1
            self._bytes[direction] += op.tensor.numel() * op.tensor.element_size()
        settle(op.future, result=None if direction == 0 else op.tensor)

    def _fail(self, op: Op, exc: BaseException) -> None:
        error = self._typed_error(op, exc)
        with self._lock:
            first = not self._closed
            self._closed = True
            if first:
                self._broken = error
            broken = self._broken
        if not first:  # already closed or broken: the error is a consequence of that
            # An op being posted when the link broke (neither queued nor in flight, so not among the ops the
            # break failed) fails as they did, naming the cause; ClosedError only when the link was closed.
            if broken is not None:
                settle(op.future, error=TransferError(f"{op.label}: the link broke: {broken}"))
            elif isinstance(exc, ClosedError):
                settle(op.future, error=exc)
            else:
                settle(op.future, error=ClosedError(f"{op.label}: the link was closed"))
            return
        _log.warning("%s", error)
        others = self._stop_pipes()  # before any callback runs: one may close the link and join its threads
        self._abort_backend()
        settle(op.future, error=error)
        for other in others:
            if other is not op:
                settle(other.future, error=TransferError(f"{other.label}: the link broke: {error}"))

    def _typed_error(self, op: Op, exc: BaseException) -> NcclKVError:
        where = f"{op.label} (link rank {self._link_rank}, peer {self._peer or 'unknown'})"
        if isinstance(exc, NcclKVError):
            error: NcclKVError = type(exc)(f"{where}: {exc}")
        elif isinstance(exc, TimeoutError) or (op.deadline and time.monotonic() >= op.deadline - _DEADLINE_SLACK_S):
            error = TransferTimeout(f"{where}: not done within {op.timeout_s:g} s: {exc}")
        else:
            error = TransferError(f"{where}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

    def _stop_pipes(self) -> list[Op]:
        return [op for pipe in self._pipes for op in pipe.stop()]

    def _abort_backend(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        self._backend.abort()
