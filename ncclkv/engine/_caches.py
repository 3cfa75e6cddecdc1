"""The paged KV caches one rank registered, checked against its shard."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .._device_wait import wait_events
from ..errors import ShapeMismatchError
from ..layout import KVGeometry, ParallelLayout, Span, shard_roi
from ..paged import CacheLayout, CacheViews, PagedCacheSpec, SlotMap, cache_views, gather, scatter
from ._buffers import WireBuffers

__all__ = ["RankCaches", "WireLease", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True, slots=True)
class _Layer:
    cache: torch.Tensor
    spec: PagedCacheSpec
    # CUDA: the torch ops' cache-side views per local head span, made at the first slice (see cache_views).
    views: dict[Span, CacheViews] | None = None

    def views_for(self, heads: Span) -> CacheViews | None:
        if self.views is None:
            return None
        found = self.views.get(heads)
        if found is None:  # two threads may both make it: the same views either way
            found = self.views[heads] = cache_views(self.cache, self.spec, heads)
        return found


class RankCaches:
    """Per-layer paged caches of this rank's shard, the gather/scatter of wire slices, and their buffers.

    Heads in routes are global kv-head indices; the cache holds the shard's
    heads from ``shard.heads.start`` on, so a route's heads are shifted by it.
    """

    def __init__(self, layout: ParallelLayout, geometry: KVGeometry, rank: int, wire_cache_bytes: int) -> None:
        self.geometry = geometry
        self.shard = shard_roi(layout, geometry, rank, 0)
        self.wire_dtype = torch_dtype(geometry.dtype)
        self._layers: dict[int, _Layer] = {}
        self._num_blocks = 0  # blocks every registered layer's cache has (the fewest of any layer's)
        self._buffers: WireBuffers | None = None  # on the caches' device, from register()
        self._wire_cache_bytes = wire_cache_bytes
        self._lock = threading.Lock()

    def register(self, kv_caches: Mapping[int, torch.Tensor], cache_layout: CacheLayout) -> None:
        """Register the caches of this rank's layers (global layer index -> tensor)."""
        want = set(self.shard.layers)
        odd = [key for key in kv_caches if isinstance(key, bool) or not isinstance(key, int)]
        if odd:
            raise ValueError(f"registered layers must be global layer indices (ints), got {odd[:8]!r}")
        if set(kv_caches) != want:
            raise ValueError(
                f"registered layers {sorted(kv_caches)} differ from this rank's layers {self.shard.layers!r}"
            )
        layers: dict[int, _Layer] = {}
        for index, cache in kv_caches.items():
            spec = PagedCacheSpec.from_tensor(cache, cache_layout)
            if spec.num_kv_heads != len(self.shard.heads) or spec.head_size != self.geometry.head_size:
                raise ShapeMismatchError(
                    f"layer {index}: cache holds {spec.num_kv_heads} heads of size {spec.head_size}, this rank's shard "
                    f"has {len(self.shard.heads)} heads {self.shard.heads!r} of size {self.geometry.head_size}"
                )
            if cache.dtype != self.wire_dtype:
                raise ShapeMismatchError(f"layer {index}: cache dtype {cache.dtype}, geometry says {self.wire_dtype}")
            if (spec.layout is CacheLayout.MLA) != self.geometry.use_mla:
                raise ShapeMismatchError(f"layer {index}: a {spec.layout.name} cache for a geometry with use_mla="
                                         f"{self.geometry.use_mla} (MLA latents need the MLA layout, and only they)")
            # CPU caches take the native kernel, which needs no views; CPU_AMX has none.
            keep_views = cache.device.type == "cuda" and spec.layout is not CacheLayout.CPU_AMX
            layers[index] = entry = _Layer(cache, spec, {} if keep_views else None)
            # What a gather checks of the cache itself (strides the kernel needs, the views of its layout),
            # here: on a link's thread it would fail after the peer was told of the tensor, breaking the link.
            local = Span(0, len(self.shard.heads))
            empty = torch.empty(self.wire_shape(Span(0, 0), local), dtype=cache.dtype, device=cache.device)
            try:
                gather(cache, spec, SlotMap([], spec.block_size), Span(0, 0), local, empty, views=entry.views_for(local))
            except (ValueError, RuntimeError) as err:
                raise ShapeMismatchError(f"layer {index}: this {spec.layout.name} cache cannot be moved: {err}") from err
        sizes = {index: entry.spec.block_size for index, entry in layers.items()}
        if len(set(sizes.values())) > 1:
            raise ShapeMismatchError(f"every layer's cache must have one block size (a request's block ids index "
                                     f"them all), got {sizes}")
        device = next(iter(layers.values())).cache.device if layers else torch.device("cpu")
        num_blocks = min((entry.spec.num_blocks for entry in layers.values()), default=0)
        with self._lock:
            self._num_blocks = num_blocks  # first: whoever sees the new layers sees their count
            self._layers = layers
            if self._buffers is None or self._buffers.device != device:
                self._buffers = WireBuffers(device, self._wire_cache_bytes)

    @property
    def registered(self) -> bool:
        return bool(self._layers)

    @property
    def device(self) -> torch.device:
        return self._any_layer().cache.device

    def ready_event(self) -> torch.cuda.Event | None:
        """CUDA: an event on the calling thread's current stream, after what the caller queued there (its
        writes of the caches); gathers wait for it wherever they run. CPU: None, the writes are done."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.current_stream(self.device).record_event()

    def scattered(self, buf: torch.Tensor) -> torch.cuda.Event | None:
        """CUDA: after a scatter from ``buf`` queued on the calling thread's current stream, keep ``buf`` from
        being handed out again before that stream is past it (it may come from another stream's pool: a staged
        push's), and return an event after the scatter, for readers to wait on. CPU: None, the scatter is done."""
        if not buf.is_cuda:
            return None
        stream = torch.cuda.current_stream(buf.device)
        buf.record_stream(stream)
        return stream.record_event()

    def order_after(self, events: Iterable[torch.cuda.Event]) -> None:
        """CUDA: what the calling thread queues next on its current stream (vLLM's attention) runs after
        ``events`` (scatters, which ran on the landing threads' streams); the host does not wait."""
        for event in events:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def wait_done(events: Iterable[torch.cuda.Event], timeout_s: float) -> int:
        """CUDA: wait until ``events`` (scatters) are done on the device, at most ``timeout_s`` in all: before a
        load is reported complete or its blocks are handed back, whatever stream reads or rewrites them next.

        Returns how many were still pending at the deadline (0: all done), for the caller to report: a device
        that stalls that long is broken, and ``Event.synchronize`` (no timeout) would hang the engine with it.
        Polled (``ncclkv._device_wait``): nothing sleeps when they are done, the usual case."""
        return wait_events(events, timeout_s)

    def block_size(self) -> int:
        return self._any_layer().spec.block_size

    def slot_map(self, block_ids: Sequence[int], tokens: Span | None = None) -> SlotMap:
        """The block table of a request, its ids checked against the caches: a bad id fails the call here, not
        a gather or scatter on a link's thread (which would break the link for every request on it).

        ``tokens``: the tokens the request moves; the blocks that hold them must be distinct (one block twice
        would send, or receive, the same bytes for two runs of tokens)."""
        self._registered()  # none registered: that error, before any about the ids
        num_blocks = self._num_blocks
        slots = SlotMap(list(block_ids), self.block_size())
        outside = [b for b in slots.block_ids if b >= num_blocks]
        if outside:
            raise ValueError(f"block ids {outside[:8]} are outside the {num_blocks} blocks of this rank's caches")
        if tokens is not None:
            repeated = slots.repeated(tokens)
            if repeated:
                raise ValueError(f"block ids {repeated[:8]} appear more than once among the blocks of tokens "
                                 f"{tokens!r}: a request's tokens need distinct blocks")
        return slots

    def wire_shape(self, tokens: Span, heads: Span, layers: int = 1) -> tuple[int, ...]:
        """One slice's shape on the wire; ``layers`` > 1: that many slices of consecutive layers, stacked."""
        g = self.geometry
        shape = (1, len(tokens), g.head_size) if g.use_mla else (2, len(tokens), len(heads), g.head_size)
        return shape if layers == 1 else (layers, *shape)

    def wire_buffer(self, tokens: Span, heads: Span, exact: bool = False, layers: int = 1) -> torch.Tensor:
        """A buffer for one slice on the wire, or ``layers`` stacked (reused on the CPU: see ``_buffers``;
        ``exact``: of its own size class only); :meth:`recycle` it after, or :meth:`forget` it if its send or
        receive failed."""
        self._registered()
        assert self._buffers is not None  # made by register()
        return self._buffers.take(self.wire_shape(tokens, heads, layers), self.wire_dtype, exact)

    @property
    def wire_cached_bytes(self) -> int:
        """Bytes of free wire buffers kept for reuse."""
        return 0 if self._buffers is None else self._buffers.cached_bytes

    def recycle(self, buf: torch.Tensor) -> None:
        """``buf`` (from :meth:`wire_buffer`) is no longer read or written: reuse it."""
        if self._buffers is not None:
            self._buffers.give(buf)

    def forget(self, buf: torch.Tensor) -> None:
        """``buf`` (from :meth:`wire_buffer`) went with a failed send or receive: never reused, no longer counted."""
        if self._buffers is not None:
            self._buffers.forget(buf)

    def hand_back(self, buf: torch.Tensor, completed: bool) -> None:
        """``buf``'s send or receive ended and nothing reads it any more: :meth:`recycle` it if the operation
        completed, :meth:`forget` it if it failed (the backend may still hold it)."""
        if completed:
            self.recycle(buf)
        else:
            self.forget(buf)

    def lease(self) -> WireLease:
        """The wire buffer of one lazily posted send (:class:`WireLease`)."""
        return WireLease(self)

    def placeholder(self, tokens: Span, heads: Span, layers: int = 1) -> torch.Tensor:
        """A ``meta`` tensor of the wire shape of one slice (or ``layers`` stacked): what a lazy send is queued
        with (see ``Link.send``)."""
        return _meta(self.wire_shape(tokens, heads, layers), self.wire_dtype)

    def gather(self, layer: int, slots: SlotMap, tokens: Span, heads: Span, out: torch.Tensor) -> torch.Tensor:
        entry, local = self._layer(layer), self._local(heads)
        return gather(entry.cache, entry.spec, slots, tokens, local, out, views=entry.views_for(local))

    def scatter(self, layer: int, wire: torch.Tensor, slots: SlotMap, tokens: Span, heads: Span) -> None:
        entry, local = self._layer(layer), self._local(heads)
        scatter(wire, entry.cache, entry.spec, slots, tokens, local, views=entry.views_for(local))

    def _registered(self) -> dict[int, _Layer]:
        layers = self._layers
        if not layers:
            raise ValueError(f"no KV caches registered on this rank (layers {self.shard.layers!r}): call register() "
                             "before moving any request")
        return layers

    def _any_layer(self) -> _Layer:
        return next(iter(self._registered().values()))

    def _local(self, heads: Span) -> Span:
        start = self.shard.heads.start
        return Span(heads.start - start, heads.stop - start)

    def _layer(self, layer: int) -> _Layer:
        entry = self._layers.get(layer)
        if entry is None:
            raise ShapeMismatchError(f"layer {layer} is not registered on this rank (layers {self.shard.layers!r})")
        return entry


@functools.lru_cache(maxsize=256)
def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Shared: a placeholder is only read (its shape and dtype), and a torch call per send hands the GIL around.
    return torch.empty(shape, dtype=dtype, device="meta")


class WireLease:
    """The wire buffer a lazily posted send's hook takes (on the link's thread, as the link posts it), and its
    hand-back when the send ends (:meth:`end`, the send's done-callback): recycled if it completed, forgotten
    if not (the backend may still hold it). A hook that runs after its send already ended, racing the link's
    failure that settles the queued sends, has its buffer forgotten at once: never left counted as out."""

    def __init__(self, caches: RankCaches) -> None:
        self._caches = caches
        self._lock = threading.Lock()
        self._bufs: list[torch.Tensor] = []
        self._ended = False

    def take(self, tokens: Span, heads: Span, layers: int = 1) -> torch.Tensor:
        buf = self._caches.wire_buffer(tokens, heads, layers=layers)
        with self._lock:
            if not self._ended:
                self._bufs.append(buf)
                return buf
        self._caches.forget(buf)  # its send ended (failed) before its hook ran: nothing will post it
        return buf

    def end(self, future: Future[Any]) -> None:
        completed = not future.cancelled() and future.exception() is None
        with self._lock:
            self._ended = True
            bufs, self._bufs = self._bufs, []
        for buf in bufs:
            self._caches.hand_back(buf, completed)
