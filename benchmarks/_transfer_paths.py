"""The data paths the transfer benchmark times, one method per path and side.

The sender (the benchmark's own process) holds a vLLM-CPU-layout paged cache
with ``src_block_size``; the receiver (a spawned peer) holds one with
``dst_block_size``. Per path:

- ``ncclkv``: gather each layer's slice -> ``Link.send``; ``Link.recv`` -> scatter
  into the other block size, on the link's receive thread as the engine's
  consumer does. Gathers run on the caller's thread while earlier
  layers are on the wire (the link's threads), as an engine's ``save_kv_layer``
  does. With ``chunk_tokens`` each layer goes as several token chunks.
- ``link``: ``Link.send`` / ``Link.recv`` of the same bytes already packed.
- ``raw``: ``ProcessGroupGloo.send`` / ``recv`` of the packed bytes, all posted at once.
- ``memcpy``: one ``copy_`` per slice in the sender's process.
- ``engine``: the product: a producer ``TransferEngine`` over the sender's cache
  pushes every request of the round (``start_push``, ``save_layer`` per
  layer, ``finish``) to a consumer engine over the receiver's cache that
  expected them all (``benchmarks._engine_path``).
- ``engine_pull``: the same engines and bytes by pull: the producer holds every
  request of the round (set-up), the consumer expects them all (its pull
  requests go out, timed) until every layer landed; the producer sends a
  route's small layers together (``pull_batch_bytes``).

Two more rounds time the ncclkv path's own copies alone, in one process each:
``gather`` (sender) and ``scatter`` (receiver), to account for the CPU they take.

"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclkv.layout import Span
from ncclkv.paged import CacheLayout, PagedCacheSpec, SlotMap, gather, scatter, set_copy_threads
from ncclkv.transport import DataPlane, Link

from ._engine_path import CONSUMER_ID, EngineReceiver, round_request_ids
from ._peer import Endpoint

__all__ = ["COPIES", "PATHS", "BytesDiffer", "PagedSide", "Receiver", "Sender", "SliceCase", "raw_group",
           "receiver_loop", "round_trips"]

PATHS = ("memcpy", "raw", "link", "ncclkv", "engine", "engine_pull")
COPIES = ("gather", "scatter")
WAIT_S = 60.0


class BytesDiffer(AssertionError):
    """A benchmarked path left other bytes than the sender's where they should have landed."""


@dataclass(frozen=True, slots=True)
class SliceCase:
    """One slice size: ``num_requests`` requests of ``num_layers`` layers per timed round."""

    slice_bytes: int
    num_layers: int
    num_requests: int
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    src_block_size: int = 16
    dst_block_size: int = 32
    chunk_tokens: int = 0  # ncclkv path: 0 sends each layer's slice as one tensor

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def token_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * self.torch_dtype.itemsize

    @property
    def num_tokens(self) -> int:
        return max(1, self.slice_bytes // self.token_bytes)

    @property
    def round_bytes(self) -> int:
        """Bytes moved per timed round."""
        return self.num_tokens * self.token_bytes * self.num_layers * self.num_requests

    def chunks(self) -> list[Span]:
        """The token spans each layer is sent in by the ncclkv path."""
        step = self.chunk_tokens or self.num_tokens
        return [Span(t, min(t + step, self.num_tokens)) for t in range(0, self.num_tokens, step)]


def _digest(tensor: torch.Tensor) -> str:
    """A hash of ``tensor``'s bytes (2-byte elements: the KV dtypes here)."""
    return hashlib.blake2b(tensor.view(torch.int16).numpy().tobytes(), digest_size=16).hexdigest()


def raw_group(store_addr: str, rank: int, prefix: str) -> dist.ProcessGroup:
    """The baseline: a bare 2-rank gloo group on the same store, bound to loopback like the links."""
    host, port = store_addr.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=WAIT_S))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=WAIT_S)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=False)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), rank, 2, options)


def _carve(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Contiguous views of ``flat`` of the given shapes, back to back."""
    views, offset = [], 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        views.append(flat[offset : offset + numel].view(shape))
        offset += numel
    return views


class PagedSide:
    """A paged cache of ``num_layers`` layers (vLLM CPU layout) with the request's blocks scattered in it."""

    def __init__(self, case: SliceCase, block_size: int, seed: int) -> None:
        self.case = case
        dtype, heads = case.torch_dtype, case.num_kv_heads
        used = -(-case.num_tokens // block_size)
        self.spec = PagedCacheSpec(CacheLayout.CPU, 2 * used + 1, block_size, heads, case.head_size, dtype)
        gen = torch.Generator().manual_seed(seed)
        self.cache = torch.empty((case.num_layers, *self.spec.shape), dtype=dtype)
        self.cache.view(torch.int16).random_(generator=gen)
        self.block_ids: list[int] = torch.randperm(self.spec.num_blocks, generator=gen)[:used].tolist()  # a busy cache
        self.slots = SlotMap(self.block_ids, block_size)
        self.heads = Span(0, heads)
        self.tokens = Span(0, case.num_tokens)

    def digests(self) -> list[str]:
        """A hash of each layer's slice as the wire format, read back out of the cache."""
        out = torch.empty(self.spec.wire_shape(len(self.tokens), len(self.heads)), dtype=self.spec.dtype)
        result = []
        for layer in range(self.case.num_layers):
            gather(self.cache[layer], self.spec, self.slots, self.tokens, self.heads, out)
            result.append(_digest(out))
        return result

    def scramble_cache(self) -> None:
        """Random bytes in the paged cache, so a later check sees only what the next round wrote there."""
        self.cache.view(torch.int16).random_()


class _Side(PagedSide):
    """A paged side with a wire buffer per message, carved from one allocation."""

    def __init__(self, case: SliceCase, block_size: int, seed: int) -> None:
        super().__init__(case, block_size, seed)
        dtype, heads = case.torch_dtype, case.num_kv_heads
        messages = case.num_layers * case.num_requests
        numel = messages * torch.Size(self.spec.wire_shape(case.num_tokens, heads)).numel()
        flat = torch.empty(numel, dtype=dtype)
        self.flat = flat  # every wire and piece below is a view of it
        self.wires = _carve(flat, [self.spec.wire_shape(case.num_tokens, heads)] * messages)
        # (layer, token span, buffer) per ncclkv message, over the same memory as the wires
        self.pieces: list[tuple[int, Span, torch.Tensor]] = []
        spans = case.chunks()
        shapes = [self.spec.wire_shape(len(span), heads) for _ in range(messages) for span in spans]
        bufs = iter(_carve(flat, shapes))
        for _ in range(case.num_requests):
            for layer in range(case.num_layers):
                self.pieces.extend((layer, span, next(bufs)) for span in spans)

    def wire_digests(self) -> list[str]:
        """A hash of each wire buffer as it is now (what the raw and link paths sent or received)."""
        return [_digest(w) for w in self.wires]

    def scramble(self, what: str) -> None:
        """Random bytes in the paged ``cache`` or in the ``wires``, so a later check sees only what the next
        round wrote there."""
        if what not in ("cache", "wires"):
            raise ValueError(f"scramble 'cache' or 'wires', got {what!r}")
        if what == "cache":
            self.scramble_cache()
        else:
            self.flat.view(torch.int16).random_()


class Sender(_Side):
    """The producer side; each path method returns once all its sends completed."""

    def __init__(self, case: SliceCase, link: Link, pg: dist.ProcessGroup) -> None:
        super().__init__(case, case.src_block_size, seed=1)
        self.link, self.pg = link, pg
        for i, wire in enumerate(self.wires):  # the packed paths send real slices
            gather(self.cache[i % case.num_layers], self.spec, self.slots, self.tokens, self.heads, wire)
        self.copies = [torch.empty_like(w) for w in self.wires]

    def ncclkv(self) -> None:
        futures = []
        for layer, span, buf in self.pieces:
            gather(self.cache[layer], self.spec, self.slots, span, self.heads, buf)
            futures.append(self.link.send(buf))
        for fut in futures:
            fut.result(WAIT_S)

    def gather_only(self) -> None:
        for layer, span, buf in self.pieces:
            gather(self.cache[layer], self.spec, self.slots, span, self.heads, buf)

    def link_only(self) -> None:
        for fut in [self.link.send(w) for w in self.wires]:
            fut.result(WAIT_S)

    def raw(self) -> None:
        for work in [self.pg.send([w], 1, 0) for w in self.wires]:
            work.wait(timedelta(seconds=WAIT_S))

    def memcpy(self) -> None:
        for src, dst in zip(self.wires, self.copies):
            dst.copy_(src)


class Receiver(_Side):
    """The consumer side: ``post_*`` posts every receive, ``finish_*`` waits (and scatters)."""

    def __init__(self, case: SliceCase, link: Link, pg: dist.ProcessGroup) -> None:
        super().__init__(case, case.dst_block_size, seed=2)
        self.link, self.pg = link, pg

    def post_ncclkv(self) -> list[Any]:
        return self._post_scattering(self.pieces)

    def finish_ncclkv(self, scattered: list[Any]) -> None:
        self._wait_scattered(scattered)

    def post_last_layer(self) -> list[Any]:
        """Receive the last layer alone (its pieces come last in the message order)."""
        return self._post_scattering(self._last_pieces())

    def finish_last_layer(self, scattered: list[Any]) -> None:
        self._wait_scattered(scattered)

    def _post_scattering(self, pieces: list[tuple[int, Span, torch.Tensor]]) -> list[Future[None]]:
        """Post each piece's receive; its scatter runs on the link's receive thread once it lands.

        That is what the engine's consumer does: no hand-off to another thread
        per message. The returned futures complete after the scatter.
        """
        scattered: list[Future[None]] = []
        for layer, span, buf in pieces:
            done: Future[None] = Future()

            def land(fut: Future[torch.Tensor], layer: int = layer, span: Span = span, done: Future[None] = done) -> None:
                try:
                    scatter(fut.result(), self.cache[layer], self.spec, self.slots, span, self.heads)
                except BaseException as err:  # noqa: BLE001 - handed to the waiter
                    done.set_exception(err)
                else:
                    done.set_result(None)

            self.link.recv(buf.shape, buf.dtype, out=buf).add_done_callback(land)
            scattered.append(done)
        return scattered

    @staticmethod
    def _wait_scattered(scattered: list[Future[None]]) -> None:
        deadline = time.monotonic() + WAIT_S
        for done in scattered:
            done.result(max(0.0, deadline - time.monotonic()))

    def _last_pieces(self) -> list[tuple[int, Span, torch.Tensor]]:
        return self.pieces[-len(self.case.chunks()):]

    def post_scatter(self) -> list[Any]:
        return []  # the buffers hold the last round's slices

    def finish_scatter(self, _: list[Any]) -> None:
        for layer, span, buf in self.pieces:
            scatter(buf, self.cache[layer], self.spec, self.slots, span, self.heads)

    def post_link(self) -> list[Any]:
        return [self.link.recv(w.shape, w.dtype, out=w) for w in self.wires]

    def finish_link(self, futures: list[Any]) -> None:
        for fut in futures:
            fut.result(WAIT_S)

    def post_raw(self) -> list[Any]:
        return [self.pg.recv([w], 0, 0) for w in self.wires]

    def finish_raw(self, works: list[Any]) -> None:
        for work in works:
            work.wait(timedelta(seconds=WAIT_S))


def round_trips(link: Link, pg: dist.ProcessGroup, nbytes: int, count: int, path: str, first: bool) -> list[float]:
    """``count`` round trips of one ``nbytes`` tensor there and an 8-byte reply back, over ``path`` (link or raw).

    ``first``: this side sends the tensor and times each round trip (seconds);
    the other side answers and returns an empty list.
    """
    if path not in ("link", "raw"):
        raise ValueError(f"round trips run over 'link' or 'raw', got {path!r}")
    payload = torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16)
    reply = torch.zeros(1, dtype=torch.int64)
    wait = timedelta(seconds=WAIT_S)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        if path == "raw" and first:
            pg.send([payload], 1, 0).wait(wait)
            pg.recv([reply], 1, 0).wait(wait)
        elif path == "raw":
            pg.recv([payload], 0, 0).wait(wait)
            pg.send([reply], 0, 0).wait(wait)
        elif first:
            sent, back = link.send(payload), link.recv(reply.shape, reply.dtype, out=reply)
            sent.result(WAIT_S), back.result(WAIT_S)
        else:
            link.recv(payload.shape, payload.dtype, out=payload).result(WAIT_S)
            link.send(reply).result(WAIT_S)
        times.append(time.perf_counter() - start)
    return times if first else []


def receiver_loop(endpoint: Endpoint, store: str, link_id: str, threads: int, copy_threads: int,
                  in_flight: int | None) -> dict[str, int]:
    """Peer side of the benchmark: cases and rounds on command until ``end``.

    ``case``: new caches; ``engine`` (producer id, address): a consumer engine
    over them; ``go`` PATH: post, answer ``ready``, finish, answer ``done``
    (time, CPU seconds, seconds); ``digests`` / ``scramble`` (payload None or
    "cache": the cache's slices; "wires": the wire buffers, what the raw and
    link paths receive into) hashed / overwritten with random bytes;
    ``round_trips``.
    """
    torch.set_num_threads(threads)
    before = set_copy_threads(copy_threads)  # this peer process serves later benchmarks too: restored below
    try:
        return _receive(endpoint, store, link_id, in_flight)
    finally:
        set_copy_threads(before)


def _receive(endpoint: Endpoint, store: str, link_id: str, in_flight: int | None) -> dict[str, int]:
    rounds = engine_rounds = pull_rounds = 0
    with DataPlane() as plane:
        depth = {} if in_flight is None else {"max_in_flight": in_flight}
        link = plane.open_link(link_id, 1, store, "cpu", WAIT_S, **depth)
        pg = raw_group(store, 1, f"raw/{link_id}")
        receiver: Receiver | None = None
        engine: EngineReceiver | None = None
        producer: tuple[str, str] = ("", "")
        try:
            while True:
                tag, payload = endpoint.receive(WAIT_S * 5)
                if tag == "end":
                    break
                if tag in ("case", "engine") and engine is not None:
                    engine.close()  # its caches are the previous case's
                    engine = None
                if tag == "case":
                    receiver = None  # free the previous case's memory first
                    receiver = Receiver(SliceCase(**payload), link, pg)
                    endpoint.send("ready")
                    continue
                if tag == "round_trips":
                    round_trips(link, pg, **payload, first=False)
                    endpoint.send("done")
                    continue
                if receiver is None:
                    raise ValueError(f"command {tag!r} before any case")
                if tag == "engine":
                    engine, producer = EngineReceiver(receiver, CONSUMER_ID), (payload[0], payload[1])
                    engine_rounds = pull_rounds = 0  # the sender counts the case's rounds from 0 too
                    endpoint.send("engine", engine.address)
                elif tag == "digests":
                    endpoint.send("digests", receiver.wire_digests() if payload == "wires" else receiver.digests())
                elif tag == "scramble":
                    receiver.scramble(payload or "cache")
                    endpoint.send("scrambled")
                elif tag == "go" and payload == "engine":
                    if engine is None:
                        raise ValueError("go engine before the engine command")
                    ids = round_request_ids(engine_rounds, receiver.case.num_requests)
                    engine_rounds += 1
                    engine.expect(ids, *producer)
                    endpoint.send("ready")
                    cpu0, start = time.process_time(), time.monotonic()  # expecting is set-up, like posting
                    end = engine.wait(ids)
                    endpoint.send("done", (end, time.process_time() - cpu0, end - start))
                    rounds += 1
                elif tag == "go" and payload == "engine_pull":
                    if engine is None:
                        raise ValueError("go engine_pull before the engine command")
                    ids = round_request_ids(pull_rounds, receiver.case.num_requests, "pull")
                    pull_rounds += 1
                    endpoint.send("ready")
                    cpu0, start = time.process_time(), time.monotonic()  # the pulls go out in expect: timed
                    engine.expect(ids, *producer, push=False)
                    end = engine.wait(ids)
                    endpoint.send("done", (end, time.process_time() - cpu0, end - start))
                    rounds += 1
                elif tag == "go":
                    post: Callable[[], list[Any]] = getattr(receiver, f"post_{payload}")
                    finish: Callable[[list[Any]], None] = getattr(receiver, f"finish_{payload}")
                    handles = post()
                    endpoint.send("ready")
                    cpu0, start = time.process_time(), time.monotonic()  # posting is set-up, like the sender's
                    finish(handles)
                    end = time.monotonic()
                    endpoint.send("done", (end, time.process_time() - cpu0, end - start))
                    rounds += 1
                else:
                    raise ValueError(f"unknown command {tag!r}")
        finally:
            if engine is not None:
                engine.close()
        link.close()
    return {"rounds": rounds}
