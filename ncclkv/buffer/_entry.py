"""Lookup-buffer entries, their keys (tokens + roi), the match rule and the prefix index."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..hashing import BlockHash, as_token_ids, hash_request_tokens
from ..layout import KVGeometry, Roi, Span, SpanSet
from ._lru import held_nbytes

__all__ = ["LookupEntry", "PrefixIndex", "entry_matches", "to_roi", "to_token_ids"]


@dataclass(frozen=True, slots=True, eq=False)
class LookupEntry:
    """One staged KV slice: the request's token ids, the roi it holds, and its tensors.

    ``as_list()`` gives what the seed's ``drop_select`` returns, as vLLM's lookup buffers do:
    ``[input_tokens, roi, key, value, hidden]`` (see :meth:`as_list`).
    """

    token_ids: tuple[int, ...]
    roi: Roi
    key: torch.Tensor
    value: torch.Tensor
    hidden: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes counted against the buffer's capacity: the storages key, value and hidden hold, each once
        (a view of a larger tensor counts all of it: the entry keeps it alive), not the token ids."""
        return held_nbytes(self.key, self.value, self.hidden)

    def as_list(self, geometry: KVGeometry | None = None) -> list[torch.Tensor | Roi | None]:
        """``[input_tokens, roi, key, value, hidden]``: the entry's token ids (int64), the roi it holds, its
        tensors. The roi is the seed's boolean token mask when it spans every layer and kv-head of
        ``geometry`` (what a mask given to ``insert`` means), else the :class:`Roi`: the caller reads
        which tokens, layers and heads the tensors hold from it (an entry may cover more than was asked)."""
        roi: torch.Tensor | Roi = self.roi
        if geometry is not None and self.roi.layers == Span(0, geometry.num_layers) \
                and self.roi.heads == Span(0, geometry.num_kv_heads):
            roi = torch.zeros(len(self.token_ids), dtype=torch.bool)
            for span in self.roi.tokens.spans:
                roi[span.start : span.stop] = True
        return [torch.tensor(self.token_ids, dtype=torch.int64), roi, self.key, self.value, self.hidden]

    def __repr__(self) -> str:
        return f"LookupEntry({len(self.token_ids)} tokens, {self.roi!r}, {self.nbytes} bytes)"


def entry_matches(entry: LookupEntry, token_ids: Sequence[int], roi: Roi, start: int = 0) -> bool:
    """The match rule: the entry's roi covers ``roi`` and the tokens agree up to ``roi``'s last token.

    KV of token i depends on tokens 0..i, so the whole prefix
    ``[0, roi.tokens.bounds.stop)`` must be equal, not only the tokens inside
    the roi. ``start`` skips a prefix already known equal (via the index).
    """
    stop = roi.tokens.bounds.stop
    return entry.roi.covers(roi) and tuple(entry.token_ids[start:stop]) == tuple(token_ids[start:stop])


def to_roi(
    roi: Roi | torch.Tensor | Sequence[bool],
    num_tokens: int,
    geometry: KVGeometry | None,
    what: str,
) -> Roi:
    """Normalise an roi argument, and check it is non-empty and within the request's tokens.

    A boolean token mask (the seed's roi) needs ``geometry`` and means every
    layer and kv-head of it; its length must equal the number of tokens.
    """
    if not isinstance(roi, Roi):
        if geometry is None:
            raise TypeError(f"{what}: roi must be a Roi (a token mask needs the buffer's geometry), got {type(roi).__name__}")
        flags = roi.tolist() if isinstance(roi, torch.Tensor) else list(roi)
        if isinstance(roi, torch.Tensor) and roi.dtype != torch.bool:
            raise TypeError(f"{what}: a token-mask roi must have dtype torch.bool, got {roi.dtype}")
        if len(flags) != num_tokens:
            raise ValueError(f"{what}: a token-mask roi needs {num_tokens} bools (one per token), got {len(flags)}")
        # 0/1 ints are refused too: an int list reads as token ids or positions as easily as a mask
        for index, flag in enumerate(flags):
            if not isinstance(flag, bool):
                raise TypeError(f"{what}: a token-mask roi must hold bools, got {type(flag).__name__} {flag!r} "
                                f"at index {index}")
        roi = Roi(SpanSet.from_mask(flags), Span(0, geometry.num_layers), Span(0, geometry.num_kv_heads))
    if roi.empty:
        raise ValueError(f"{what}: roi {roi!r} is empty")
    if roi.tokens.bounds.stop > num_tokens:
        raise ValueError(f"{what}: roi {roi!r} reaches token {roi.tokens.bounds.stop}, beyond the {num_tokens} input tokens")
    return roi


def to_token_ids(input_tokens: torch.Tensor | Sequence[int], what: str) -> tuple[int, ...]:
    if isinstance(input_tokens, torch.Tensor) and input_tokens.dim() != 1:
        raise ValueError(f"{what}: input_tokens must be 1-D, got shape {tuple(input_tokens.shape)}")
    return as_token_ids(input_tokens, f"{what}: input_tokens")


class PrefixIndex:
    """Entry ids by the chained hash of each whole block of their token prefix.

    An entry whose roi ends at token ``stop`` is listed under the hashes of
    its first 1, 2, ..., ``stop // block_size`` blocks. A query ending at
    ``stop`` looks in the bucket of its first ``stop // block_size`` blocks
    (every entry whose tokens agree that far) and compares at most
    ``block_size - 1`` further tokens per candidate; a query shorter than one
    block has no bucket and the caller scans every entry. Not thread-safe.
    """

    __slots__ = ("block_size", "_buckets")

    def __init__(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"index_block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self._buckets: dict[BlockHash, dict[int, None]] = {}

    def entry_keys(self, token_ids: tuple[int, ...], roi: Roi) -> tuple[BlockHash, ...]:
        return tuple(hash_request_tokens(self.block_size, token_ids[: roi.tokens.bounds.stop]))

    def query_key(self, token_ids: tuple[int, ...], roi: Roi) -> tuple[BlockHash | None, int]:
        """The bucket to search and how many leading tokens it guarantees equal."""
        checked = roi.tokens.bounds.stop // self.block_size * self.block_size
        if checked == 0:
            return None, 0
        return hash_request_tokens(self.block_size, token_ids[:checked])[-1], checked

    def add(self, entry_id: int, keys: tuple[BlockHash, ...]) -> None:
        for key in keys:
            self._buckets.setdefault(key, {})[entry_id] = None

    def remove(self, entry_id: int, keys: tuple[BlockHash, ...]) -> None:
        for key in keys:
            bucket = self._buckets[key]
            del bucket[entry_id]
            if not bucket:
                del self._buckets[key]

    def candidates(self, key: BlockHash) -> Iterator[int]:
        return iter(self._buckets.get(key, ()))

    def __len__(self) -> int:
        return len(self._buckets)

    def clear(self) -> None:
        self._buckets.clear()
