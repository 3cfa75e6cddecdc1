"""Counters of one engine rank: bytes, tensors, and per-layer receive latency."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["EngineStats", "StatsSnapshot"]


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    bytes_sent: int
    tensors_sent: int
    requests_sent: int
    send_seconds: float
    bytes_received: int
    tensors_received: int
    requests_received: int
    requests_failed: int
    # layer -> seconds from expect() until that layer had fully landed, summed over requests
    layer_wait_seconds: dict[int, float]
    layer_wait_count: dict[int, int]
    # handshakes this rank refused as responder (the initiator gets the HandshakeError)
    handshakes_refused: int = 0
    # a level, not a counter: free wire buffers this rank keeps for reuse now (CPU; see engine/_buffers.py)
    wire_buffers_cached_bytes: int = 0
    # expected requests aborted before they were reported (their caller gave them up: neither received nor
    # failed, so each expected request counts once in one of the three)
    requests_aborted: int = 0


@dataclass(slots=True)
class EngineStats:
    bytes_sent: int = 0
    tensors_sent: int = 0
    requests_sent: int = 0
    send_seconds: float = 0.0
    bytes_received: int = 0
    tensors_received: int = 0
    requests_received: int = 0
    requests_failed: int = 0
    layer_wait_seconds: dict[int, float] = field(default_factory=dict)
    layer_wait_count: dict[int, int] = field(default_factory=dict)
    handshakes_refused: int = 0
    requests_aborted: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_send(self, nbytes: int, tensors: int, seconds: float) -> None:
        with self.lock:
            self.bytes_sent += nbytes
            self.tensors_sent += tensors
            self.requests_sent += 1
            self.send_seconds += seconds

    def record_tensor(self, nbytes: int) -> None:
        with self.lock:
            self.bytes_received += nbytes
            self.tensors_received += 1

    def record_layer(self, layer: int, seconds: float) -> None:
        with self.lock:
            self.layer_wait_seconds[layer] = self.layer_wait_seconds.get(layer, 0.0) + seconds
            self.layer_wait_count[layer] = self.layer_wait_count.get(layer, 0) + 1

    def record_refused_handshake(self) -> None:
        with self.lock:
            self.handshakes_refused += 1

    def record_request(self, failed: bool) -> None:
        with self.lock:
            if failed:
                self.requests_failed += 1
            else:
                self.requests_received += 1

    def record_abort(self) -> None:
        with self.lock:
            self.requests_aborted += 1

    def snapshot(self, wire_buffers_cached_bytes: int = 0) -> StatsSnapshot:
        """The counters now, with the level the caller reads from the rank's wire buffers."""
        with self.lock:
            return StatsSnapshot(
                self.bytes_sent, self.tensors_sent, self.requests_sent, self.send_seconds, self.bytes_received,
                self.tensors_received, self.requests_received, self.requests_failed,
                dict(self.layer_wait_seconds), dict(self.layer_wait_count), self.handshakes_refused,
                wire_buffers_cached_bytes, self.requests_aborted,
            )
