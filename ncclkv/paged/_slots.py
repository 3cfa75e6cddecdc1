"""Where a request's tokens live in a paged cache, precomputed once per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layout import Span

__all__ = ["BlockRun", "SlicePlan", "SlotMap"]

# Plans kept per SlotMap: a request is usually moved in one or two token spans.
_MAX_PLANS = 16


@dataclass(frozen=True, slots=True)
class BlockRun:
    """``length`` tokens at wire offset ``wire_start`` that sit in one block from ``offset`` on."""

    wire_start: int
    block_id: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True, eq=False)
class SlicePlan:
    """A token span cut into partial-block runs and a run of whole blocks.

    Whole blocks cover wire tokens ``[full_start, full_start + len(full_block_ids) * block_size)``
    and are moved with one indexed copy over ``block_index`` (on the cache's device).
    """

    tokens: Span
    block_size: int
    edges: tuple[BlockRun, ...]
    full_start: int
    full_block_ids: tuple[int, ...]
    block_index: torch.Tensor | None
    max_block_id: int
    distinct: bool


class SlotMap:
    """A request's block table: token ``t`` lives in block ``block_ids[t // block_size]`` at offset ``t % block_size``.

    Build one per request and cache block size and pass it to every per-layer
    gather/scatter: the block-index tensor of each token span is made on first
    use and kept, so later calls allocate nothing.
    """

    __slots__ = ("_block_ids", "_block_size", "_ids_cpu", "_plans")

    def __init__(self, block_ids: Sequence[int] | torch.Tensor, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
                raise ValueError(f"block_ids must be a 1-D integer tensor, got {block_ids.dtype} {list(block_ids.shape)}")
            ids = tuple(int(b) for b in block_ids.tolist())  # one device sync, once per request
        else:
            ids = tuple(block_ids)
            for block_id in ids:
                if isinstance(block_id, bool) or not isinstance(block_id, int):
                    raise ValueError(f"block ids must be ints, got {block_id!r} in {list(ids)[:8]}")
        negative = [b for b in ids if b < 0]
        if negative:
            raise ValueError(f"block ids must be >= 0, got {negative[:8]}")
        if max(ids, default=0) >= 2**63:  # the native kernel reads the table as int64
            raise ValueError(f"block ids must be < 2**63, got {[b for b in ids if b >= 2**63][:8]}")
        self._block_ids = ids
        self._block_size = block_size
        self._ids_cpu: torch.Tensor | None = None
        self._plans: dict[tuple[int, int, torch.device], SlicePlan] = {}

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self._block_ids

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def _kernel_ids(self) -> torch.Tensor:
        """The block ids as a contiguous int64 CPU tensor (made on first use, then kept): what the native kernel
        reads, unchecked (they were checked once, as the tuple). Private: written to, it would send C past the
        cache."""
        if self._ids_cpu is None:
            self._ids_cpu = torch.tensor(self._block_ids, dtype=torch.int64)
        return self._ids_cpu

    @property
    def num_tokens(self) -> int:
        """How many token positions the blocks hold."""
        return len(self._block_ids) * self._block_size

    def __repr__(self) -> str:
        return f"SlotMap(blocks={len(self._block_ids)}, block_size={self._block_size})"

    def repeated(self, tokens: Span) -> list[int]:
        """The block ids that stand more than once among the blocks holding ``tokens`` (sorted; none: [])."""
        size = self._block_size
        used = self._block_ids[tokens.start // size : -(-tokens.stop // size)] if len(tokens) else ()
        if len(set(used)) == len(used):
            return []
        return sorted({b for b in used if used.count(b) > 1})

    def plan(self, tokens: Span, device: torch.device | str = "cpu") -> SlicePlan:
        """The cut of ``tokens`` into block runs, with its index tensor on ``device`` (cached)."""
        device = torch.device(device)
        key = (tokens.start, tokens.stop, device)
        found = self._plans.get(key)
        if found is not None:
            return found
        if tokens.stop > self.num_tokens:
            raise ValueError(
                f"token span {tokens!r} runs past the {len(self._block_ids)} blocks given "
                f"({self.num_tokens} tokens at block_size {self._block_size})"
            )
        plan = self._cut(tokens, device)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _cut(self, tokens: Span, device: torch.device) -> SlicePlan:
        ids, bs = self._block_ids, self._block_size
        edges: list[BlockRun] = []
        pos = tokens.start
        if pos % bs and pos < tokens.stop:  # partial first block
            length = min(tokens.stop, (pos // bs + 1) * bs) - pos
            edges.append(BlockRun(0, ids[pos // bs], pos % bs, length))
            pos += length
        full_start = pos - tokens.start
        num_full = (tokens.stop - pos) // bs
        full_ids = ids[pos // bs : pos // bs + num_full]
        pos += num_full * bs
        if pos < tokens.stop:  # partial last block
            edges.append(BlockRun(pos - tokens.start, ids[pos // bs], 0, tokens.stop - pos))
        used = list(full_ids) + [run.block_id for run in edges]
        index = torch.tensor(full_ids, dtype=torch.int64, device=device) if full_ids else None
        return SlicePlan(
            tokens=tokens,
            block_size=bs,
            edges=tuple(edges),
            full_start=full_start,
            full_block_ids=full_ids,
            block_index=index,
            max_block_id=max(used, default=-1),
            distinct=len(set(used)) == len(used),
        )
