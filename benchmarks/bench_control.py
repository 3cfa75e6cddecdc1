"""Control-plane cost per request, and link creation time per peer pair, between two processes.

Requests: the consumer (this process) sends a PullRequest through
:class:`ncclkv.channel.Channel` and waits for the Ack (a request/reply round
trip); the producer (a spawned peer) then sends one Announce per layer and a
Done, as the engine's producer does, and the request ends when the Done
arrives. Links: both processes call ``DataPlane.open_link`` for a new link id;
the first link of a data plane also creates its gloo device. Reported: min,
p50, p99 and max over all requests (links), after a warm-up.

    python -m benchmarks.bench_control [--quick] [--out DIR] [--repeats N]
"""

from __future__ import annotations

import argparse
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ncclkv.channel import Channel
from ncclkv.layout import Span
from ncclkv.protocol import Ack, Announce, Done, Message, PullRequest, RouteMsg
from ncclkv.transport import DataPlane

from ._common import (
    BenchContext, BenchOptions, BenchResult, Column, base_meta, default_out, pyplot, run_standalone,
    standalone_command, summary, write_figure,
)
from ._peer import Endpoint

__all__ = ["NAME", "TITLE", "ControlParams", "main", "plot", "producer_peer", "run"]

NAME = "control"
TITLE = "Control plane per request (ZMQ channel) and link creation per peer pair"
WAIT_S = 30.0
TOKENS, HEADS, HEAD_SIZE = 2048, 4, 128  # one TP rank's slice of a 2k-token request, bfloat16
ROUTES = (RouteMsg.from_spans(0, 0, Span(0, 32), Span(0, 4), Span(0, TOKENS)),
          RouteMsg.from_spans(1, 0, Span(0, 32), Span(4, 8), Span(0, TOKENS)))


@dataclass(frozen=True, slots=True)
class ControlParams:
    num_requests: int = 1000
    layers: tuple[int, ...] = (1, 32)  # Announces per request
    num_links: int = 30

    @classmethod
    def quick(cls) -> ControlParams:
        return cls(num_requests=60, layers=(1, 32), num_links=6)


def _announce(request_id: str, layer: int) -> Announce:
    shape = (2, TOKENS, HEADS, HEAD_SIZE)
    return Announce(request_id, layer, ROUTES[0], shape, "bfloat16", 2 * TOKENS * HEADS * HEAD_SIZE * 2, layer, "kv-bench")


def producer_peer(endpoint: Endpoint, store: str) -> dict[str, int]:
    """Peer side: answer pulls (Ack, then Announces and a Done from a worker thread) and open links on command."""
    jobs: queue.SimpleQueue[tuple[str, str, int] | None] = queue.SimpleQueue()

    def on_message(sender: str, body: Message) -> Message | None:
        if isinstance(body, PullRequest):
            jobs.put((sender, body.request_id, body.num_tokens))  # num_tokens carries the layer count here
            return Ack(body.request_id, None)
        return None

    served = 0
    with Channel(f"bench-producer-{uuid.uuid4().hex[:6]}", on_message=on_message) as channel:
        def serve() -> None:
            nonlocal served
            while (job := jobs.get()) is not None:
                sender, request_id, layers = job
                for layer in range(layers):
                    channel.send(sender, _announce(request_id, layer))
                channel.send(sender, Done(request_id, layers, layers * 2 * TOKENS * HEADS * HEAD_SIZE * 2))
                served += 1

        worker = threading.Thread(target=serve, name="bench-producer", daemon=True)
        worker.start()
        try:
            endpoint.send("channel", (channel.peer_id, channel.address))
            with DataPlane() as plane:
                while (command := endpoint.receive(WAIT_S * 4))[0] == "open":
                    start = time.monotonic()
                    link = plane.open_link(command[1], 1, store, "cpu", WAIT_S)
                    opened = time.monotonic() - start
                    probe = link.recv((4,), torch.int32).result(WAIT_S)  # the link carries data
                    link.close()
                    endpoint.send("opened", (opened, probe.tolist()))
        finally:
            jobs.put(None)
            worker.join(WAIT_S)
    return {"requests": served}


class _Consumer:
    """Counts Announces per request and signals each Done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, threading.Event] = {}
        self.announced: dict[str, int] = {}

    def expect(self, request_id: str) -> threading.Event:
        with self._lock:
            event = self._done[request_id] = threading.Event()
            self.announced[request_id] = 0
            return event

    def on_message(self, sender: str, body: Message) -> Message | None:
        with self._lock:
            if isinstance(body, Announce):
                self.announced[body.request_id] += 1
            elif isinstance(body, Done):
                self._done.pop(body.request_id).set()
        return None


def _requests(channel: Channel, producer: str, consumer: _Consumer, layers: int, count: int,
              ctx: BenchContext) -> tuple[list[float], list[float]]:
    """Round trips PullRequest -> Ack and whole requests PullRequest -> Done, in seconds."""
    pulls, totals = [], []
    warmup = max(2, count // 10)
    for i in range(warmup + count):
        if i % 50 == 0:
            ctx.progress(f"{NAME}: {layers} layer(s) per request, {i}/{warmup + count}")
        request_id = f"req-{layers}-{i}"
        done = consumer.expect(request_id)
        start = time.perf_counter()
        channel.request(producer, PullRequest(request_id, 0, "bench-consumer", ROUTES, layers), WAIT_S)
        acked = time.perf_counter()
        if not done.wait(WAIT_S):
            raise TimeoutError(f"no Done for {request_id} within {WAIT_S} s")
        finished = time.perf_counter()
        if consumer.announced.pop(request_id) != layers:
            raise AssertionError(f"{request_id}: expected {layers} Announces before the Done")
        if i >= warmup:
            pulls.append(acked - start)
            totals.append(finished - start)
    return pulls, totals


def _links(plane: DataPlane, peer: Any, count: int, ctx: BenchContext) -> tuple[list[float], list[float]]:
    ours, theirs = [], []
    for i in range(count):
        ctx.progress(f"{NAME}: link {i + 1}/{count}")
        link_id = f"bench-control-{uuid.uuid4().hex[:8]}"
        peer.endpoint.send("open", link_id)
        start = time.monotonic()
        link = plane.open_link(link_id, 0, plane.address, "cpu", WAIT_S)
        ours.append(time.monotonic() - start)
        link.send(torch.arange(4, dtype=torch.int32)).result(WAIT_S)
        opened, probe = peer.endpoint.expect("opened")
        if probe != [0, 1, 2, 3]:
            raise AssertionError(f"link {link_id} delivered {probe}")
        link.close()
        theirs.append(opened)
    return ours, theirs


def _row(what: str, seconds: Sequence[float]) -> dict[str, Any]:
    stats = summary(seconds)
    return {"what": what, "n": len(seconds), **{f"{k}_us": 1e6 * v for k, v in stats.items() if k != "count"}}


COLUMNS = (
    Column("what", "what", align="<"),
    Column("n", "n", "{:d}"),
    Column("min_us", "min us", "{:.0f}"),
    Column("median_us", "p50 us", "{:.0f}"),
    Column("p99_us", "p99 us", "{:.0f}"),
    Column("max_us", "max us", "{:.0f}"),
)

ANALYSIS = """\
A request's control traffic is one request/reply round trip (PullRequest ->
Ack) plus one one-way message per layer (Announce) and a Done. Each message
costs an msgspec encode (with a decode check), a hop through the channel's I/O
thread and ZMQ, and the peer's dispatcher thread: tens of microseconds each on
an idle core, more on two busy ones (the p99). The one-way messages pipeline,
so a 32-layer request costs a few hundred microseconds more than a 1-layer one,
small next to moving its KV (tens of milliseconds here) but proportional to the
number of layers; announcing all layers of a route in one message would make
it constant. Link creation is a TCPStore rendezvous plus a gloo pair connect,
about 1-2 ms here, paid once per peer pair, not per request; the first link
of a data plane also creates its gloo device. The peer side's time includes
waiting for this side to join, hence its outliers.
The machine's speed moves these numbers between days and hours: the
PullRequest -> Ack round trip took 91 us at p50 on 2026-11-22, 279 us on the
morning of 2026-11-24 and 525-531 us in two runs that afternoon (memcpy at
about half its morning speed, see bench transfer), with the same channel code.
"""


def plot(result: BenchResult, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = result.rows
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(rows) + 1.5))
    names = [r["what"] for r in rows][::-1]
    for key, marker in (("min_us", "|"), ("median_us", "o"), ("p99_us", "x")):
        ax.scatter([r[key] for r in rows][::-1], names, marker=marker, label=key.removesuffix("_us"))
    ax.set(xscale="log", xlabel="microseconds")
    ax.set_title(result.title, fontsize=9)
    ax.legend(fontsize=8)
    return write_figure(plt, fig, path)


def run(ctx: BenchContext, params: ControlParams | None = None) -> BenchResult:
    opts = ctx.options
    params = params or (ControlParams.quick() if opts.quick else ControlParams())
    count = params.num_requests if opts.repeats is None else opts.repeats
    peer = ctx.peer()
    consumer = _Consumer()
    rows: list[dict[str, Any]] = []
    with DataPlane() as plane, Channel(f"bench-consumer-{uuid.uuid4().hex[:6]}", on_message=consumer.on_message) as channel:
        peer.start("benchmarks.bench_control:producer_peer", store=plane.address)
        try:
            producer, address = peer.endpoint.expect("channel")
            channel.connect(producer, address)
            for layers in params.layers:
                pulls, totals = _requests(channel, producer, consumer, layers, count, ctx)
                if layers == params.layers[0]:
                    rows.append(_row("PullRequest -> Ack round trip", pulls))
                rows.append(_row(f"request with {layers} layer(s): Pull, Ack, {layers} Announce, Done", totals))
            ours, theirs = _links(plane, peer, max(2, params.num_links), ctx)
            rows.append(_row("open_link, first link of both data planes (creates the gloo devices)", theirs[:1]))
            rows.append(_row("open_link per peer pair (this side)", ours[1:]))
            rows.append(_row("open_link per peer pair (peer side)", theirs[1:]))
        finally:
            peer.endpoint.send("end")
            peer.result()
    meta = {
        **base_meta(opts), "requests": count,
        "layers": list(params.layers), "links": params.num_links,
        "messages": f"PullRequest with {len(ROUTES)} routes; Announce of a [2, {TOKENS}, {HEADS}, {HEAD_SIZE}] bfloat16 slice",
        "timing": "perf_counter in the consumer; requests one at a time; first 10% dropped as warm-up",
    }
    headline = [f"{r['what']}: p50 {r['median_us']:.0f} us, p99 {r['p99_us']:.0f} us" for r in rows]
    return BenchResult(NAME, TITLE, COLUMNS, rows, meta, headline, ANALYSIS)


def _parse(argv: Sequence[str] | None) -> BenchOptions:
    parser = argparse.ArgumentParser(prog="bench_control", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, help="requests per row (default 1000; quick 60)")
    args = parser.parse_args(argv)
    command = standalone_command("bench_control", argv)
    return BenchOptions(args.quick, args.repeats, args.out or default_out(args.quick), command)


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(run, plot, _parse(argv))


if __name__ == "__main__":
    raise SystemExit(main())
