"""The blend retriever: find each prompt's chunks in the :class:`ChunkStore`, layer by layer.

``new_request(full_prompts, indices)`` cuts each prompt at its chunk starts
(``indices``; token 0 always starts a chunk) and returns a task whose
background thread looks every chunk up once (so validity is the same for
every layer) and then assembles each layer's K/V for the whole batch on the
target device, a few layers ahead of the model. On CUDA it copies on a side
stream and waits for the copies (at most ``deadline_s``) before handing a layer over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._device_wait import wait_events
from .._env import env_settings
from .._timeout import check_timeout
from ..errors import ShapeMismatchError, TransferTimeout
from ..hashing import as_token_ids
from ._prefetch import LayerPrefetcher
from ._store import ChunkStore, StoredChunk
from ._types import BlendRetrieverResult

__all__ = ["BlendRetriever", "BlendRetrieverTask"]


@dataclass(frozen=True, slots=True)
class _Segment:
    """One chunk of one prompt: tokens ``[start, stop)`` of the batch, starting at ``offset`` in its prompt."""

    request: int
    start: int
    stop: int
    offset: int
    token_ids: tuple[int, ...]


class BlendRetriever:
    """Makes :class:`BlendRetrieverTask` s over one :class:`ChunkStore`.

    ``device``: where results are put. ``lookahead``: layers assembled ahead of
    the one asked for. ``deadline_s``: the default wait of ``result()``, and how
    long the thread waits for the model to ask for more before it ends quietly
    (the next ``result()`` starts it again; default: ``NCCLKV_DEADLINE_S``).
    """

    def __init__(self, store: ChunkStore, *, device: torch.device | str = "cpu", lookahead: int = 2,
                 deadline_s: float | None = None) -> None:
        if not isinstance(store, ChunkStore):
            raise TypeError(f"store must be a ChunkStore, got {type(store).__name__}")
        self.store = store
        self.device = torch.device(device)
        self.lookahead = lookahead
        self.deadline_s = env_settings().deadline_s if deadline_s is None else check_timeout("deadline_s", deadline_s)

    def new_request(self, full_prompts: Sequence[torch.Tensor], indices: Sequence[Sequence[int]]) -> BlendRetrieverTask:
        """Start retrieving for a batch; ``indices[i]`` are the chunk starts within ``full_prompts[i]``."""
        return BlendRetrieverTask(self, _segments(full_prompts, indices))


class BlendRetrieverTask:
    """The retrieval of one batch (the seed's ``BlendRetrieverTask``); close it, or use ``with``."""

    def __init__(self, retriever: BlendRetriever, segments: tuple[list[_Segment], list[int]]) -> None:
        self._segments, bounds = segments
        self._store = retriever.store
        self.device = retriever.device
        self._deadline_s = retriever.deadline_s
        self.num_layers = retriever.store.num_layers
        self.num_tokens = bounds[-1]
        self.query_start_loc = torch.tensor(bounds, dtype=torch.int64)
        #: Each token's position in its own prompt (the new positions).
        self.positions = torch.cat([torch.arange(b - a, dtype=torch.int64) for a, b in zip(bounds, bounds[1:])])
        self._found: list[tuple[_Segment, StoredChunk]] = []
        self._valid_mask = torch.zeros(self.num_tokens, dtype=torch.bool)
        self._original_positions = torch.zeros(self.num_tokens, dtype=torch.int64)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self._stream is not None:  # chunks this thread stored are still being written on its stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._prefetcher: LayerPrefetcher[BlendRetrieverResult] = LayerPrefetcher(
            "blend-retriever", self.num_layers, self._assemble, prepare=self._lookup,
            lookahead=retriever.lookahead, deadline_s=retriever.deadline_s)

    @property
    def segments(self) -> list[tuple[int, int]]:
        """The chunks, as ``[start, stop)`` token ranges of the batch."""
        return [(s.start, s.stop) for s in self._segments]

    @property
    def prefetching(self) -> bool:
        """Whether the background thread is still running."""
        return self._prefetcher.alive

    def result(self, layer_id: int, timeout_s: float | None = None) -> BlendRetrieverResult:
        """Layer ``layer_id`` of the whole batch (blocks at most ``timeout_s``; each layer once).

        ``valid_mask`` and ``original_positions`` are shared by every layer's result: read only.
        """
        result = self._prefetcher.get(layer_id, timeout_s)
        if self._stream is not None and result.k is not None and result.v is not None:
            consumer = torch.cuda.current_stream(self.device)
            for t in (result.k, result.v, result.original_positions):
                t.record_stream(consumer)  # allocated on the side stream, used on this one
        return result

    def close(self) -> None:
        """Stop and join the background thread (idempotent)."""
        self._prefetcher.close()

    def __enter__(self) -> BlendRetrieverTask:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lookup(self) -> None:
        first: StoredChunk | None = None
        for segment in self._segments:
            chunk = self._store.lookup(segment.token_ids)
            if chunk is None:
                continue
            mine = (chunk.kv[0].dtype, chunk.kv[0].shape[2:])
            if first is not None and mine != (first.kv[0].dtype, first.kv[0].shape[2:]):
                raise ShapeMismatchError(
                    f"chunk at tokens [{segment.start}, {segment.stop}) has KV {chunk.kv[0].dtype} "
                    f"{tuple(chunk.kv[0].shape[2:])} per token, an earlier chunk {first.kv[0].dtype} "
                    f"{tuple(first.kv[0].shape[2:])}")
            if first is None:
                first = chunk
            self._found.append((segment, chunk))
            self._valid_mask[segment.start:segment.stop] = True
            self._original_positions[segment.start:segment.stop] = chunk.positions
        self._original_positions = self._original_positions.to(self.device)

    def _assemble(self, layer: int) -> BlendRetrieverResult:
        if not self._found:
            return BlendRetrieverResult(None, None, self._valid_mask, self._original_positions)
        sample = self._found[0][1].kv[layer]
        shape = (2, self.num_tokens) + tuple(sample.shape[2:])
        if self._stream is None:
            kv = self._fill(layer, shape, sample.dtype)
        else:
            with torch.cuda.stream(self._stream):
                kv = self._fill(layer, shape, sample.dtype)
            self._wait_copies(layer)
        return BlendRetrieverResult(kv[0], kv[1], self._valid_mask, self._original_positions)

    def _wait_copies(self, layer: int) -> None:
        """CUDA: wait until the side stream's copies of ``layer`` are done, at most ``deadline_s``, else
        :class:`TransferTimeout` (``result()`` raises it). ``Stream.synchronize`` has no timeout: a stalled device
        would hold this thread for good, and ``close()`` would fail to join it."""
        done = torch.cuda.Event()
        done.record(self._stream)
        if wait_events([done], self._deadline_s):
            raise TransferTimeout(f"blend retriever: the copies of layer {layer} to {self.device} were not done "
                                  f"within deadline_s={self._deadline_s:g} s (a stalled device?)")

    def _fill(self, layer: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        kv = torch.empty(shape, dtype=dtype, device=self.device)
        covered = 0
        for segment, chunk in self._found:
            kv[:, covered:segment.start].zero_()  # tokens of chunks not found
            kv[:, segment.start:segment.stop].copy_(chunk.kv[layer], non_blocking=True)
            covered = segment.stop
        kv[:, covered:].zero_()
        return kv


def _segments(full_prompts: Sequence[torch.Tensor],
              indices: Sequence[Sequence[int]]) -> tuple[list[_Segment], list[int]]:
    """Cut every prompt at its chunk starts; returns the segments and the batch's query_start_loc."""
    if len(full_prompts) == 0 or len(full_prompts) != len(indices):
        raise ValueError(f"need one list of chunk starts per prompt and >= 1 prompt, got "
                         f"{len(full_prompts)} prompts and {len(indices)} index lists")
    segments: list[_Segment] = []
    bounds = [0]
    for request, (prompt, starts) in enumerate(zip(full_prompts, indices)):
        if isinstance(prompt, torch.Tensor) and prompt.dim() != 1:
            raise ValueError(f"prompt {request} must be 1-D, got shape {tuple(prompt.shape)}")
        ids = as_token_ids(prompt, f"prompt {request}")
        starts = [int(s) for s in starts]
        rising = all(a < b for a, b in zip(starts, starts[1:]))
        if not ids or not rising or (starts and not 0 <= starts[0] <= starts[-1] < len(ids)):
            raise ValueError(f"prompt {request}: chunk starts {starts} must rise strictly within "
                             f"[0, {len(ids)}) (and the prompt must not be empty)")
        cuts = sorted({0, *starts}) + [len(ids)]
        for a, b in zip(cuts, cuts[1:]):
            segments.append(_Segment(request, bounds[-1] + a, bounds[-1] + b, a, ids[a:b]))
        bounds.append(bounds[-1] + len(ids))
    return segments, bounds
