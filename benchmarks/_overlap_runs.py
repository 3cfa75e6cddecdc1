"""The pieces of a synthetic prefill that bench_overlap times: busy compute and the per-layer transfer modes.

Times are read on the monotonic clock, which the receiver (a peer process
running :func:`benchmarks._transfer_paths.receiver_loop`) shares.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ncclkv.paged import gather

from ._engine_path import EngineSender
from ._transfer_paths import WAIT_S, Sender, SliceCase

__all__ = ["ENGINE_MODES", "MODES", "Busy", "calibrate_slice", "chunked", "compute_alone", "engine_scenario", "scenario"]


class Busy:
    """Compute for about ``ms`` milliseconds: a loop of ``n x n`` float32 matmuls on the current torch threads."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self._a, self._b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        self._c = torch.empty(n, n)
        self._iters = 1
        for _ in range(3):  # warm up the kernels, then measure
            self.spin(20)
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            self.spin(20)
            samples.append((time.perf_counter() - start) / 20)
        self.matmul_s = statistics.median(samples)

    def spin(self, iters: int) -> None:
        for _ in range(iters):
            torch.mm(self._a, self._b, out=self._c)

    def for_ms(self, ms: float) -> Callable[[], None]:
        iters = max(1, round(ms / 1e3 / self.matmul_s))
        return lambda: self.spin(iters)


def _send_layer(sender: Sender, layer: int) -> list[Any]:
    futures = []
    for piece_layer, span, buf in sender.pieces:
        if piece_layer == layer:
            gather(sender.cache[layer], sender.spec, sender.slots, span, sender.heads, buf)
            futures.append(sender.link.send(buf))
    return futures


def compute_alone(compute: Callable[[], None], layers: int) -> tuple[float, float, float]:
    """The prefill's compute with nothing sent: (start, end, end)."""
    start = time.monotonic()
    for _ in range(layers):
        compute()
    end = time.monotonic()
    return start, end, end


def scenario(mode: str, sender: Sender, compute: Callable[[], None], peer: Any) -> tuple[float, float, float]:
    """(start, end of the last compute, receiver done) on the shared monotonic clock."""
    layers = sender.case.num_layers
    if mode == "single":  # the last layer alone: its latency, gather -> wire -> scatter
        peer.endpoint.send("go", "last_layer")
        peer.endpoint.expect("ready")
        start = time.monotonic()
        for fut in _send_layer(sender, layers - 1):
            fut.result(WAIT_S)
        done, _, _ = peer.endpoint.expect("done")
        return start, start, done
    if mode == "compute":
        return compute_alone(compute, layers)
    peer.endpoint.send("go", "ncclkv")
    peer.endpoint.expect("ready")
    start = time.monotonic()
    futures: list[Any] = []
    if mode == "transfer":
        compute_end = start
        sender.ncclkv()
    elif mode == "layerwise":
        for layer in range(layers):
            compute()
            if layer == layers - 1:
                compute_end = time.monotonic()
            futures += _send_layer(sender, layer)
    else:  # after compute
        for _ in range(layers):
            compute()
        compute_end = time.monotonic()
        sender.ncclkv()
    for fut in futures:
        fut.result(WAIT_S)
    done, _, _ = peer.endpoint.expect("done")
    return start, compute_end, done


MODES = ("compute", "transfer", "single", "layerwise", "after")
ENGINE_MODES = ("compute", "transfer", "layerwise", "after")


def engine_scenario(mode: str, sender: EngineSender, compute: Callable[[], None], peer: Any,
                    request_id: str) -> tuple[float, float, float]:
    """One pushed request through real engines: (start, end of the last compute, consumer done).

    ``start_push`` comes before ``start`` (the connector starts a push when the
    request is scheduled); ``transfer`` saves every layer at once (x),
    ``layerwise`` saves each after its compute, ``after`` computes all first.
    """
    layers = sender.side.case.num_layers
    if mode == "compute":
        return compute_alone(compute, layers)
    if mode not in ENGINE_MODES:
        raise ValueError(f"engine mode must be one of {ENGINE_MODES}, got {mode!r}")
    ids = [request_id]
    peer.endpoint.send("expect", (request_id, sender.engine_id, sender.address))
    peer.endpoint.expect("ready")
    sender.start(ids)
    start = compute_end = time.monotonic()
    if mode == "after":
        for _ in range(layers):
            compute()
        compute_end = time.monotonic()
    for layer in range(layers):
        if mode == "layerwise":
            compute()
            compute_end = time.monotonic()
        sender.save_layer(ids, layer)
    sender.finish(ids)
    done = peer.endpoint.expect("done")
    sender.await_sent(ids)
    return start, compute_end, done


def calibrate_slice(sender_factory: Callable[[SliceCase], Sender], peer: Any, x_ms: float, layers: int) -> SliceCase:
    """A slice size whose ncclkv transfer takes about ``x_ms`` per layer in a pipelined round."""
    probe = SliceCase(4 << 20, layers, 1)
    sender = sender_factory(probe)
    samples = []
    for _ in range(3):
        start, _, done = scenario("transfer", sender, lambda: None, peer)
        samples.append(done - start)
    per_byte = statistics.median(samples) / probe.round_bytes
    slice_bytes = int(x_ms / 1e3 / per_byte)
    return SliceCase(max(probe.token_bytes, slice_bytes - slice_bytes % probe.token_bytes), layers, 1)


def chunked(case: SliceCase, chunk_bytes: int) -> SliceCase:
    if not chunk_bytes or chunk_bytes >= case.num_tokens * case.token_bytes:
        return replace(case, chunk_tokens=0)
    return replace(case, chunk_tokens=max(1, chunk_bytes // case.token_bytes))
