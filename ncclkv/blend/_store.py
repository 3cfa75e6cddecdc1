"""Text chunks' KV in the store buffer, keyed by the chunk's own tokens.

A chunk (a retrieved document, say) is prefilled on its own, at whatever
positions, and stored per layer. Its key is the stable hash of its tokens
alone (:func:`hash_block_tokens` with no parent), so it is found wherever it
sits in a later prompt. The positions it was computed at are stored with it:
the executor needs them to re-rotate K to the new positions.

Buffer entries, under ``<namespace>/<chunk hex>/``:

* ``L<layer>``: ``[2, num_tokens, num_kv_heads, head_size]``, K then V;
* ``pos``: int64 ``[num_tokens]`` on the CPU, written last (a chunk whose
  ``pos`` is present was stored completely).

The buffer evicts entries one by one, so a lookup takes a chunk only if
``pos`` and every layer are present, and then holds references to all of
them (the buffer stores by reference: later evictions cannot take them away).
Stores, lookups and drops of chunks hold the buffer's ``group_lock``: two
stores of one chunk at other positions, or a lookup beside a store, never mix
one store's positions with the other's layers (every ChunkStore on one buffer
shares that lock).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..buffer import KVStoreBuffer
from ..errors import CapacityError
from ..hashing import ExtraKeys, as_token_ids, hash_block_tokens
from ._rope import check_heads

__all__ = ["ChunkStore", "StoredChunk"]


@dataclass(frozen=True, slots=True, eq=False)
class StoredChunk:
    """A chunk found in the store: its key, the positions it was computed at, KV per layer."""

    key: str
    positions: torch.Tensor
    kv: tuple[torch.Tensor, ...]

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()


class ChunkStore:
    """Per-layer KV of text chunks in a :class:`KVStoreBuffer` (see the module docstring).

    ``extra_keys`` go into every chunk hash: put there whatever else makes KV
    of equal tokens differ (the model, a LoRA adapter, a cache salt).
    ``storage_device``: where stored tensors live (None = where they come from).
    """

    def __init__(
        self,
        buffer: KVStoreBuffer,
        num_layers: int,
        *,
        namespace: str = "blend",
        extra_keys: ExtraKeys | None = None,
        storage_device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(buffer, KVStoreBuffer):
            raise TypeError(f"buffer must be a KVStoreBuffer, got {type(buffer).__name__}")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        if not namespace or "/" in namespace:
            raise ValueError(f"namespace must be a non-empty string without '/', got {namespace!r}")
        self.buffer = buffer
        self.num_layers = num_layers
        self.namespace = namespace
        self.extra_keys = extra_keys
        self.storage_device = None if storage_device is None else torch.device(storage_device)
        hash_block_tokens(None, [0], extra_keys)  # reject bad extra_keys now, not at the first store

    def chunk_key(self, token_ids: Sequence[int] | torch.Tensor) -> str:
        """The chunk's key: the hex of the stable hash of its tokens (and ``extra_keys``)."""
        ids = as_token_ids(token_ids, "chunk token_ids")
        if not ids:
            raise ValueError("a chunk must have at least one token")
        return hash_block_tokens(None, ids, self.extra_keys).hex()

    def store_chunk(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        k_per_layer: Sequence[torch.Tensor],
        v_per_layer: Sequence[torch.Tensor],
        positions: Sequence[int] | torch.Tensor,
    ) -> str:
        """Store a chunk's K and V (each ``[num_tokens, num_kv_heads, head_size]`` per layer)
        computed at ``positions``; replaces a chunk of the same tokens. Returns its key.

        Raises CapacityError, storing nothing, if the chunk is larger than the buffer or
        (``evict=False``) does not fit beside what it holds; any earlier copy of the
        chunk is then gone too.
        """
        ids = as_token_ids(token_ids, "chunk token_ids")
        key, num_tokens = self.chunk_key(ids), len(ids)
        pos = _positions(positions, num_tokens)
        kv = self._stacked(k_per_layer, v_per_layer, num_tokens)
        nbytes = sum(t.nbytes for t in kv) + pos.nbytes
        if nbytes > self.buffer.capacity_bytes:
            # Its own layers would evict each other: the chunk could never be found.
            raise CapacityError(f"chunk {key} of {num_tokens} tokens needs {nbytes} bytes, the buffer holds "
                                f"{self.buffer.capacity_bytes}")
        part = "pos"
        with self.buffer.group_lock:
            try:
                self.buffer.put(self._key(key, "pos"), None)  # not findable while half written
                for layer, tensor in enumerate(kv):
                    part = f"L{layer}"
                    self.buffer.put(self._key(key, part), tensor)
                part = "pos"
                self.buffer.put(self._key(key, part), pos)
            except CapacityError as error:
                # Without pos the layers already put could never be found, yet they would hold capacity
                # for good with eviction off: drop them (and any older copy's layers, equally unreachable).
                # Under the group lock still: a store of this chunk by another thread, once the lock is free,
                # must not lose its layers to this take-back.
                self._drop(key)
                raise CapacityError(
                    f"chunk {key} of {num_tokens} tokens (positions {int(pos.min())}..{int(pos.max())}) did not "
                    f"fit at {part}; nothing of it is stored: {error}"
                ) from error
        return key

    def lookup(self, token_ids: Sequence[int] | torch.Tensor) -> StoredChunk | None:
        """The stored chunk of exactly these tokens, with every layer, or None."""
        key = self.chunk_key(token_ids)
        with self.buffer.group_lock:  # one store's positions and layers, not two stores' mixed
            pos = self.buffer.get(self._key(key, "pos"))
            if pos is None:
                return None
            kv = []
            for layer in range(self.num_layers):
                tensor = self.buffer.get(self._key(key, f"L{layer}"))
                if tensor is None:
                    return None  # partly evicted
                kv.append(tensor)
        return StoredChunk(key, pos, tuple(kv))

    def drop_chunk(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Remove a chunk (no error if absent)."""
        self._drop(self.chunk_key(token_ids))

    def _drop(self, key: str) -> None:
        with self.buffer.group_lock:
            self.buffer.put(self._key(key, "pos"), None)  # first: never findable with layers missing
            for layer in range(self.num_layers):
                self.buffer.put(self._key(key, f"L{layer}"), None)

    def _key(self, chunk_key: str, part: str) -> str:
        return f"{self.namespace}/{chunk_key}/{part}"

    def _stacked(self, k_per_layer: Sequence[torch.Tensor], v_per_layer: Sequence[torch.Tensor],
                 num_tokens: int) -> list[torch.Tensor]:
        if len(k_per_layer) != self.num_layers or len(v_per_layer) != self.num_layers:
            raise ValueError(f"need K and V for {self.num_layers} layers, got {len(k_per_layer)} "
                             f"and {len(v_per_layer)}")
        first = k_per_layer[0]
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"layer 0 K must be a torch.Tensor, got {type(first).__name__}")
        # RoPE re-rotation works per head: a flat [num_tokens, num_heads * head_size] could not be re-rotated.
        check_heads("layer 0 K", first)
        expected = (num_tokens,) + tuple(first.shape[1:])
        out = []
        for layer, (k, v) in enumerate(zip(k_per_layer, v_per_layer)):
            for name, t in (("K", k), ("V", v)):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected or t.dtype != first.dtype:
                    got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"layer {layer} {name} must be {first.dtype} {expected} "
                                     f"[num_tokens, num_kv_heads, head_size], got {got}")
            # A copy: the caller may reuse its tensors after storing.
            out.append(torch.stack((k, v)).detach().to(self.storage_device or k.device))
        return out


def _positions(positions: Sequence[int] | torch.Tensor, num_tokens: int) -> torch.Tensor:
    pos = positions if isinstance(positions, torch.Tensor) else torch.tensor(list(positions))
    if pos.dim() != 1 or pos.numel() != num_tokens or pos.is_floating_point() or pos.dtype == torch.bool:
        raise ValueError(f"positions must be {num_tokens} integers (one per chunk token), got "
                         f"{pos.dtype} {tuple(pos.shape)}")
    if num_tokens and int(pos.min()) < 0:
        raise ValueError(f"positions must be >= 0, got min {int(pos.min())}")
    return pos.detach().to(device="cpu", dtype=torch.int64).clone()
