"""The transfer engine's own path in the benchmarks: a real TransferEngine on each side of the peer pipe.

Each side wraps a :class:`PagedSide` it already has (the same caches as the
link paths: vLLM CPU layout, blocks of 16 on the producer and 32 on the
consumer, scattered at random). The producer pushes as the connector's
``save_kv_layer`` does: ``start_push`` when a request starts, ``save_layer``
after each layer, ``finish`` after the last, with ``piece_bytes`` from the
row. The consumer ``expect``s every push before it starts and waits until
every layer landed. So each announcement, push offer and completion goes over
the engines' real ZMQ channels, and every byte through their links, wire
buffers, gather and scatter. bench_transfer times rounds of many requests
(throughput); bench_overlap times one request against compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ncclkv.engine import DEFAULT_LAST_PIECE_BYTES, EngineConfig, EngineRef, Role, TransferEngine
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.paged import CacheLayout

from ._peer import WAIT_S

if TYPE_CHECKING:  # _transfer_paths hosts a receiver of this module's in its peer loop
    from ._transfer_paths import PagedSide

__all__ = ["CONSUMER_ID", "EngineReceiver", "EngineSender", "consumer_loop", "round_request_ids"]

CONSUMER_ID = "bench-consumer"
_LAYOUT = ParallelLayout(1, 1)
_POLL_S = 0.001  # the producer's finished set has no blocking variant; nothing timed waits on this poll


def round_request_ids(round_index: int, num_requests: int, kind: str = "round") -> list[str]:
    """The request ids of one timed round (``kind``: "round" for pushes, "pull" for pulls, so the two never share
    an id); both processes count rounds, so both name them alike."""
    return [f"{kind}{round_index}-req{i}" for i in range(num_requests)]


def _engine(side: PagedSide, engine_id: str, role: Role, piece_bytes: int, last_piece_bytes: int) -> TransferEngine:
    case = side.case
    geometry = KVGeometry(case.num_layers, case.num_kv_heads, case.head_size, case.dtype)
    engine = TransferEngine(EngineConfig(engine_id, 0, _LAYOUT, geometry, role=role, deadline_s=WAIT_S,
                                         piece_bytes=piece_bytes, last_piece_bytes=last_piece_bytes))
    try:
        engine.register({layer: side.cache[layer] for layer in range(case.num_layers)}, CacheLayout.CPU)
    except BaseException:
        engine.close()
        raise
    return engine


class EngineSender:
    """A producer engine over ``side``'s cache; :meth:`push` streams requests to one consumer engine."""

    def __init__(self, side: PagedSide, engine_id: str, piece_bytes: int = 0,
                 last_piece_bytes: int = DEFAULT_LAST_PIECE_BYTES) -> None:
        self.side = side
        self.engine_id = engine_id
        self.engine = _engine(side, engine_id, "producer", piece_bytes, last_piece_bytes)
        self._consumer: EngineRef | None = None

    @property
    def address(self) -> str:
        return self.engine.address

    def connect(self, consumer_id: str, consumer_address: str) -> None:
        self._consumer = EngineRef(consumer_id, _LAYOUT, (consumer_address,))

    def start(self, request_ids: Sequence[str]) -> None:
        """``start_push`` each request (the offers go out on the engine's threads)."""
        if self._consumer is None:
            raise RuntimeError("EngineSender.connect(consumer_id, consumer_address) first")
        for request_id in request_ids:
            self.engine.start_push(request_id, self._consumer, self.side.block_ids, self.side.case.num_tokens)

    def save_layer(self, request_ids: Sequence[str], layer: int) -> None:
        for request_id in request_ids:
            self.engine.save_layer(request_id, layer)

    def finish(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.engine.finish(request_id)

    def hold(self, request_ids: Sequence[str]) -> None:
        """Hold each request's blocks for a pull (what a prefill does when its prompt is done)."""
        for request_id in request_ids:
            self.engine.finish(request_id, self.side.block_ids, self.side.case.num_tokens)

    def push(self, request_ids: Sequence[str], before_layer: Callable[[int], None] | None = None) -> None:
        """Start, save every layer (after ``before_layer(layer)``: compute) and finish each request."""
        self.start(request_ids)
        for layer in range(self.side.case.num_layers):
            if before_layer is not None:
                before_layer(layer)
            self.save_layer(request_ids, layer)
        self.finish(request_ids)

    def await_sent(self, request_ids: Sequence[str]) -> None:
        """Until the engine reported every request sent; raise a failed one's error."""
        left, deadline = set(request_ids), time.monotonic() + WAIT_S
        while left:
            for request_id, error in self.engine.take_finished_sending().items():
                if error is not None:
                    raise error
                left.discard(request_id)
            if left and time.monotonic() > deadline:
                raise TimeoutError(f"pushes {sorted(left)} not reported sent within {WAIT_S} s")
            if left:
                threading.Event().wait(_POLL_S)

    def close(self) -> None:
        self.engine.close()


class EngineReceiver:
    """A consumer engine over ``side``'s cache: expects pushes, or pulls, into the side's blocks."""

    def __init__(self, side: PagedSide, engine_id: str) -> None:
        self.side = side
        self.engine_id = engine_id
        self.engine = _engine(side, engine_id, "consumer", 0, 0)

    @property
    def address(self) -> str:
        return self.engine.address

    def expect(self, request_ids: Sequence[str], producer_id: str, producer_address: str, push: bool = True) -> None:
        """Expect each request pushed, or (``push`` False) pull it: its pull requests go out here."""
        producer = EngineRef(producer_id, _LAYOUT, (producer_address,))
        for request_id in request_ids:
            self.engine.expect(request_id, producer, self.side.block_ids, self.side.case.num_tokens, push=push)

    def wait(self, request_ids: Sequence[str]) -> float:
        """Until every request landed (checked as reported finished); the monotonic time the last one did."""
        deadline = time.monotonic() + WAIT_S
        for request_id in request_ids:
            self.engine.wait(request_id, max(0.0, deadline - time.monotonic()))
        done = time.monotonic()
        finished = self.engine.take_finished_receiving()
        bad = {rid: finished.get(rid, "not reported") for rid in request_ids if finished.get(rid, KeyError) is not None}
        if bad:
            raise RuntimeError(f"requests landed but were reported as {bad!r}")
        return done

    def close(self) -> None:
        self.engine.close()


def consumer_loop(endpoint: Any, case: dict[str, Any]) -> dict[str, int]:
    """Peer side of bench_overlap's engine rows: one consumer engine over its own cache, until ``end``.

    ``expect`` (request id, producer id, producer address): expect that push,
    answer ``ready``, wait until it landed, answer ``done`` with the time;
    ``digests``: the cache's slices hashed; ``scramble``: new random bytes in
    the cache, so a later ``digests`` sees only later pushes.
    """
    from ._transfer_paths import PagedSide, SliceCase  # noqa: PLC0415 - see the TYPE_CHECKING import

    slice_case = SliceCase(**case)
    side = PagedSide(slice_case, slice_case.dst_block_size, seed=2)
    receiver = EngineReceiver(side, CONSUMER_ID)
    requests = 0
    try:
        endpoint.send("address", receiver.address)
        while True:
            tag, payload = endpoint.receive(WAIT_S * 5)
            if tag == "end":
                break
            if tag == "digests":
                endpoint.send("digests", side.digests())
            elif tag == "scramble":
                side.scramble_cache()
                endpoint.send("scrambled")
            elif tag == "expect":
                request_id, producer_id, producer_address = payload
                receiver.expect([request_id], producer_id, producer_address)
                endpoint.send("ready")
                endpoint.send("done", receiver.wait([request_id]))
                requests += 1
            else:
                raise ValueError(f"unknown command {tag!r}")
    finally:
        receiver.close()
    return {"requests": requests}
