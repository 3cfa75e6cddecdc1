"""What one consumer rank knows of a request it expects, and the arithmetic of its slices' token pieces.

A (layer, route) slice lands whole or in pieces of its tokens (a producer's
``chunk_bytes``); each piece is recorded as announced, as received (its bytes
here) and as landed (scattered), and a piece that overlaps one recorded before
is refused. Pure bookkeeping: the consumer (``_consumer``) holds the lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import NcclKVError, TransferError
from ..layout import Span, SpanSet
from ..paged import SlotMap
from ..transport import LinkBase
from ._config import EngineRef
from ._push_stage import SliceKey

__all__ = ["Expected", "add_piece", "as_ncclkv", "awaits", "covers_slice", "layers_text", "overlaps"]


@dataclass(slots=True)
class Expected:
    """A request this rank expects (pulled, or pushed): its plan, the pieces announced, received and landed."""

    request_id: str
    producer: EngineRef
    slots: SlotMap
    pending: set[SliceKey]
    per_src: dict[int, int]  # (layer, route) slices each producer rank will send us (what its Done counts)
    remaining: dict[int, int]  # layer -> (layer, route) slices still to land (each in one piece or several)
    started: float  # time.monotonic(): latencies are wall time
    progress: float  # the channel clock: the no-progress deadline leaves out our own pauses
    nbytes: int = 0
    error: BaseException | None = None
    announced: dict[SliceKey, SpanSet] = field(default_factory=dict)  # tokens of each slice announced so far
    # Tokens of each slice whose bytes arrived (being scattered, or scattered): a loss of their producer rank
    # afterwards takes nothing from the request.
    received: dict[SliceKey, SpanSet] = field(default_factory=dict)
    landed: dict[SliceKey, SpanSet] = field(default_factory=dict)  # tokens of each slice scattered so far
    links: dict[int, LinkBase] = field(default_factory=dict)  # producer rank -> the link its tensors come on
    push: bool = False  # pushed: nothing arrives before the producer's prefill runs
    num_tokens: int = 0  # push: the tokens expected (its offers must say as many)
    applying: int = 0  # scatters into the request's blocks running right now
    keep: int = 0  # tokens below this are already in the blocks (shared with other requests): never written
    unsent: int = 0  # pulls with routes not yet acknowledged by their producer rank (see _stall_at)
    # Producer rank -> the loss_seq stamp of the handshake its pull was acknowledged under (see fail_peer).
    acked: dict[int, int] = field(default_factory=dict)
    since_seq: int = 0  # the channel's loss_seq when it was expected: a loss reported up to it came before it
    hold: int = 0  # pull: the producer's number of the hold pulled (expect(..., hold=)); 0: not named
    # CUDA: per layer, an event after each scatter into the request's blocks (the landing threads' streams are
    # not the forward's): waited for by the forward's stream (wait_layer) or the host (take_finished, abort).
    scattered: dict[int, list[torch.cuda.Event]] = field(default_factory=dict)

    def all_scattered(self) -> list[torch.cuda.Event]:
        """The events after every scatter into the request's blocks, every layer's, each once (a tensor of
        several layers has one event for them all) (CUDA; else none)."""
        return list(dict.fromkeys(event for events in self.scattered.values() for event in events))


def add_piece(pieces: dict[SliceKey, SpanSet], key: SliceKey, piece: Span) -> SpanSet | None:
    """Record ``piece`` of slice ``key`` and return the slice's tokens recorded so far; None if it overlaps
    a piece recorded before (nothing recorded)."""
    seen = pieces.get(key)  # None: the first piece, and for whole slices the only one (no set arithmetic)
    if seen is not None and not seen.intersect(piece).empty:
        return None
    merged = pieces[key] = SpanSet((piece,)) if seen is None else seen.union(SpanSet((piece,)))
    return merged


def overlaps(pieces: dict[SliceKey, SpanSet], key: SliceKey, piece: Span) -> bool:
    """Whether ``piece`` overlaps a piece of slice ``key`` recorded before (what ``add_piece`` refuses)."""
    seen = pieces.get(key)
    return seen is not None and not seen.intersect(piece).empty


def covers_slice(tokens: SpanSet | None, key: SliceKey) -> bool:
    """Whether ``tokens`` (pieces inside the slice's route, checked as announced; None: none) are all of the
    slice's."""
    return tokens is not None and tokens.spans == (key[2].tokens,)


def awaits(req: Expected, rank: int) -> bool:
    """Whether ``req`` waits for bytes of a tensor producer rank ``rank`` announced (its receive posted)."""
    return any(key[0] == rank and req.received.get(key) != tokens for key, tokens in req.announced.items())


def layers_text(keys: Sequence[SliceKey]) -> str:
    """``layer 3``, or ``layers 3-5`` for a tensor of several layers' slices (consecutive, in order)."""
    first, last = keys[0][1], keys[-1][1]
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def as_ncclkv(error: BaseException) -> NcclKVError:
    """``error`` as one of ours (its type kept when it is one)."""
    return error if isinstance(error, NcclKVError) else TransferError(f"{type(error).__name__}: {error}")
