"""Frame headers: each tensor's size, shape and dtype, sent on a side tag before it can land (gloo links).

Why: gloo checks an arriving message against the receive it lands in on its
device thread (``gloo/transport/tcp/pair.cc``, ``Pair::prepareRead``:
``GLOO_ENFORCE_LE(op.preamble.length, op.nbytes)``), and ``Loop::run``
catches nothing, so a peer that sends more bytes than the posted receive
ends the *receiving* process with ``std::terminate``. A shorter send
completes the receive with its tail untouched, silently. gloo's sender
writes a payload only once the matching receive is posted, so a receiver
that learns the size first, and never posts a receive that does not match,
keeps those bytes off the wire: the link breaks with ShapeMismatchError.

The sender describes the tensors it posts (empty ones included) in headers
on :data:`FRAME_TAG`, up to :data:`BATCH` tensors or :data:`FLUSH_BYTES` per
header, at once when nothing else of the sender's is on the wire, and once
its send side found nothing more to post for :data:`GRACE_S` (raw gloo
here: one header per 64 KiB-1 MiB tensor cost 20-35% of the throughput,
one per 8 tensors about 5%); the receiver keeps header receives posted
ahead and checks each receive against its entry before posting it. This holds against every sender that goes through
:class:`~ncclkv.transport.Link` (a buggy or skewed producer, a receiver that
lost step) and against one that sends without headers (its receive is never
posted; the link times out). A process that writes headers of its own can
still end ours: gloo cannot be guarded in-process (docs/ARCHITECTURE.md).
NCCL links do not frame: NCCL has no tags, and reading a header would cost a
host sync per tensor.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ProtocolError, ShapeMismatchError, TransferError, TransferTimeout
from ._pipe import MIN_WAIT_S, Pending

__all__ = [
    "AHEAD_BYTES", "BATCH", "EARLY_FLUSH_BYTES", "FLUSH_BYTES", "FRAME_TAG", "GRACE_S", "Frame", "Framing",
    "RecvFrames", "SendFrames", "check", "decode", "encode",
]

FRAME_TAG = 2  # data uses tag 0, TorchBackend.abort tag 1
BATCH = 8  # entries per header: one small message per 8 tensors instead of one per tensor
FLUSH_BYTES = 4 << 20  # past this much undescribed data a header goes out at once: the wire waits for it
GRACE_S = 0.00005  # an idle send side waits this long for more sends before it flushes a part-full header
# A send filled as it is posted (Link.send's fill: the producer's gather) whose tensor is at least this large gets
# its header at once, ahead of the fill, so the peer posts its receive while the bytes are written (a 1 MiB gather
# takes 0.1-0.3 ms here, about a header's trip); smaller ones batch as any send does.
EARLY_FLUSH_BYTES = 1 << 20
# A send with a fill describes (and announces) the queued sends after it ahead of their turn, up to BATCH - 1 of
# them holding at most this many bytes (the first whatever its size): the peer then posts their receives while
# this one is on the wire.
AHEAD_BYTES = FLUSH_BYTES
_MAGIC = 0x6E636B76_66726D32  # "nckvfrm2"
_HEAD_WORDS = 4  # magic, first frame index, count, reserved
_ENTRY_WORDS = 8  # nbytes, dtype code, ndim, up to 5 dims
_MAX_DIMS = _ENTRY_WORDS - 3
_WORDS = _HEAD_WORDS + BATCH * _ENTRY_WORDS
# Codes are positions: append only, both ends of a link must agree.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32,
    torch.uint64, torch.complex64, torch.complex128,
)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True, slots=True)
class Framing:
    """A backend's side channel for headers: post one header send / receive to the peer."""

    post_send: Callable[[torch.Tensor], Pending]
    post_recv: Callable[[torch.Tensor], Pending]


@dataclass(frozen=True, slots=True)
class Frame:
    """One header entry: the tensor behind frame ``index``. shape/dtype None: not expressible in a header."""

    index: int
    nbytes: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None

    def describe(self) -> str:
        shape = "?" if self.shape is None else str(self.shape)
        return f"{shape} {self.dtype or 'dtype ?'} ({self.nbytes} B)"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _entry(tensor: torch.Tensor) -> list[int]:
    shape = tuple(tensor.shape)
    fits = len(shape) <= _MAX_DIMS
    words = [_nbytes(tensor), _CODES.get(tensor.dtype, -1), len(shape) if fits else -1]
    if fits:
        words.extend(shape)
    words.extend([0] * (_ENTRY_WORDS - len(words)))
    return words


def _words(first: int, entries: Sequence[list[int]]) -> list[int]:
    words = [_MAGIC, first, len(entries), 0]
    for entry in entries:
        words.extend(entry)
    words.extend([0] * (_WORDS - len(words)))
    return words


def encode(first: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The header describing ``tensors`` as frames ``first``, ``first + 1``, ..."""
    if not 1 <= len(tensors) <= BATCH:
        raise ValueError(f"a header holds 1 to {BATCH} tensors, got {len(tensors)}")
    return torch.tensor(_words(first, [_entry(t) for t in tensors]), dtype=torch.int64)


def decode(header: torch.Tensor) -> list[Frame]:
    words = header.numpy().tolist()  # numpy's tolist is a few times cheaper than torch's here
    if words[0] != _MAGIC or not 1 <= words[2] <= BATCH:
        raise ProtocolError(f"not a frame header (magic {words[0]:#x}, count {words[2]})")
    frames = []
    for i in range(words[2]):
        at = _HEAD_WORDS + i * _ENTRY_WORDS
        nbytes, code, ndim = words[at:at + 3]
        dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else None
        shape = tuple(words[at + 3:at + 3 + ndim]) if 0 <= ndim <= _MAX_DIMS else None
        frames.append(Frame(words[1] + i, nbytes, dtype, shape))
    return frames


def check(frame: Frame, index: int, tensor: torch.Tensor) -> None:
    """Raise unless ``frame`` is frame ``index`` and carries exactly what ``tensor`` was posted for."""
    if frame.index != index:
        raise ProtocolError(f"frame header entry {frame.index} arrived where frame {index} was due")
    same = frame.nbytes == _nbytes(tensor)
    same = same and (frame.shape is None or frame.shape == tuple(tensor.shape))
    same = same and (frame.dtype is None or frame.dtype == tensor.dtype)
    if not same:
        raise ShapeMismatchError(
            f"the peer sends {frame.describe()}, this receive was posted (as announced) for {tuple(tensor.shape)} "
            f"{tensor.dtype} ({_nbytes(tensor)} B); nothing of it was received, the link is closed")


class SendFrames:
    """The sending half, used by one thread at a time (the send pipe's gate holder): :meth:`add`, :meth:`flush`.

    A tensor may be posted before its header: gloo writes it only once the
    receive is posted, which waits for the header. Headers live in a ring of
    ``ring`` tensors, each reused only once its send is complete: every header
    describes at least one tensor, and a tensor not yet received is in flight
    or described ahead of its post (at most ``BATCH`` of those, see
    ``Link._describe_ahead``), so with ``ring`` above both counts every
    tensor described by the header ``ring`` headers back has been received,
    hence that header too.
    """

    def __init__(self, framing: Framing, ring: int) -> None:
        if ring < 2:
            raise ValueError(f"ring must be >= 2, got {ring}")
        self._post = framing.post_send
        self._ring = ring
        self._headers: list[tuple[torch.Tensor, Any]] = []  # (header, its numpy view: cheap to fill)
        self._posted: list[Pending | None] = [None] * ring  # keeps each header's work alive until reuse
        self._sent = 0  # headers posted
        self._next = 0  # frames described so far, posted or not
        self._entries: list[list[int]] = []
        self._bytes = 0
        self._since = 0.0  # when the oldest entry not yet flushed was added

    @property
    def pending(self) -> int:
        """Entries added since the last flush."""
        return len(self._entries)

    @property
    def due(self) -> bool:
        """Whether the entries held reach :data:`BATCH` or :data:`FLUSH_BYTES` (``add`` would have flushed)."""
        return len(self._entries) >= BATCH or self._bytes >= FLUSH_BYTES

    def add(self, tensor: torch.Tensor, urgent: bool = False, hold: bool = False) -> Pending | None:
        """Describe ``tensor``, the next frame; return the header's pending if this flushed an empty tensor.

        Flushes at :data:`BATCH` entries or :data:`FLUSH_BYTES`, or at once if
        ``urgent`` (nothing else of ours is on the wire: the peer may be idle,
        waiting for this header). An empty tensor moves no data, so its send
        completes with (and waits for) its header. ``hold``: never flush here,
        the caller flushes (with room for the entry: at most :data:`BATCH`).
        """
        if hold and len(self._entries) >= BATCH:
            raise ValueError(f"a header holds {BATCH} entries; flush before adding more")
        if not self._entries:
            self._since = time.monotonic()
        self._entries.append(_entry(tensor))
        self._bytes += _nbytes(tensor)
        if hold:
            return None
        if tensor.numel() == 0:
            return self.flush()
        if urgent or len(self._entries) == BATCH or self._bytes >= FLUSH_BYTES:
            self.flush()
        return None

    def idle(self, full: bool) -> float | None:
        """The send side has nothing to post: flush once the oldest entry waited :data:`GRACE_S`.

        ``full``: sends are queued but the window is full; they wait for
        sends in flight, which wait for this header: flush now. Returns how
        long until the flush (the thread waits at most that long), or None.
        """
        if not self._entries:
            return None
        left = self._since + GRACE_S - time.monotonic()
        if left > 0 and not full:
            return left
        self.flush()
        return None

    def flush(self) -> Pending | None:
        """Post the header of every tensor added since the last flush (none: nothing to do)."""
        if not self._entries:
            return None
        slot = self._sent % self._ring
        if slot == len(self._headers):  # allocated on first use: most link ends send in one direction only
            header = torch.empty(_WORDS, dtype=torch.int64)
            self._headers.append((header, header.numpy()))
        header, words = self._headers[slot]
        words[:] = _words(self._next, self._entries)
        self._next += len(self._entries)
        self._entries.clear()
        self._bytes = 0
        self._sent += 1
        self._posted[slot] = pending = self._post(header)
        return pending


class RecvFrames:
    """The receiving half: header receives posted ``depth`` ahead, one entry checked per receive, in order.

    Used by one thread only (the link's receive poster); the first check posts the first headers.
    """

    def __init__(self, framing: Framing, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._post = framing.post_recv
        self._depth = depth
        self._ahead: deque[tuple[torch.Tensor, Pending]] = deque()
        self._frames: deque[Frame] = deque()
        self._next = 0

    def check_next(self, tensor: torch.Tensor, deadline: float, timeout_s: float) -> None:
        """Wait (up to ``deadline``) for the next frame's header; raise unless it matches ``tensor``."""
        if not self._frames:
            self._frames.extend(self._next_header(deadline, timeout_s))
        check(self._frames.popleft(), self._next, tensor)
        self._next += 1

    def clear(self) -> None:
        """Forget the headers posted ahead (after the backend was aborted)."""
        self._ahead.clear()

    def _next_header(self, deadline: float, timeout_s: float) -> list[Frame]:
        if not self._ahead:
            for _ in range(self._depth):
                header = torch.empty(_WORDS, dtype=torch.int64)
                self._ahead.append((header, self._post(header)))
        header, pending = self._ahead.popleft()
        try:
            pending.wait(max(MIN_WAIT_S, deadline - time.monotonic()))
        except Exception as exc:  # timed out, or the connection failed
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if isinstance(exc, TimeoutError) or time.monotonic() >= deadline - 0.02:
                raise TransferTimeout(f"no frame header from the peer within {timeout_s:g} s: {text}") from exc
            raise TransferError(f"frame header receive failed: {text}") from exc
        frames = decode(header)
        self._ahead.append((header, self._post(header)))  # the same tensor, posted again for a later header
        return frames
