"""The prefill/decode set a launch script starts: which global rank plays which engine rank.

Global ranks are laid out instance after instance, prefill instances first:
``[prefill 0][prefill 1]...[decode 0][decode 1]...``; inside an instance the
rank is ``pp_rank * tp_size + tp_rank`` (:class:`ncclkv.layout.ParallelLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import ParallelLayout

__all__ = ["PDTopology", "RankPlace"]


@dataclass(frozen=True, slots=True)
class RankPlace:
    """One global rank's engine role and coordinates."""

    role: str  # "prefill" | "decode"
    instance: int
    tp_rank: int
    pp_rank: int

    def __str__(self) -> str:
        return f"{self.role}[{self.instance}] tp_rank={self.tp_rank} pp_rank={self.pp_rank}"


@dataclass(frozen=True, slots=True)
class PDTopology:
    """``num_prefill`` engines of layout ``prefill`` and ``num_decode`` engines of layout ``decode``."""

    num_prefill: int
    prefill: ParallelLayout
    num_decode: int
    decode: ParallelLayout

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PDTopology.{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.num_prefill * self.prefill.world_size + self.num_decode * self.decode.world_size

    def place(self, rank: int) -> RankPlace:
        """The role and coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} outside the world_size={self.world_size} of {self}")
        prefill_ranks = self.num_prefill * self.prefill.world_size
        role, layout, offset = "prefill", self.prefill, rank
        if rank >= prefill_ranks:
            role, layout, offset = "decode", self.decode, rank - prefill_ranks
        tp_rank, pp_rank = layout.coords(offset % layout.world_size)
        return RankPlace(role, offset // layout.world_size, tp_rank, pp_rank)

    def check_world(self, world_size: int, launcher: str) -> None:
        """ValueError unless the launcher started exactly this topology's number of ranks."""
        if world_size != self.world_size:
            raise ValueError(f"{self} needs {self.world_size} ranks, {launcher} started {world_size}")

    def __str__(self) -> str:
        return (
            f"{self.num_prefill}P(tp={self.prefill.tp_size},pp={self.prefill.pp_size})"
            f"+{self.num_decode}D(tp={self.decode.tp_size},pp={self.decode.pp_size})"
        )
