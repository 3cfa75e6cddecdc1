"""Parallel layouts and KV geometry: plain values, no torch, no network."""

from __future__ import annotations

from dataclasses import dataclass

from ._span import Span

__all__ = ["DTYPE_SIZES", "MAX_WORLD_SIZE", "KVGeometry", "ParallelLayout", "pp_layer_spans"]

# Ranks one engine may have (tp_size x pp_size): far past any deployment, and a bound on the plans a peer's
# layout costs (a handshake declaring 65536 x 8 ranks made each of its pulls plan over half a million ranks).
MAX_WORLD_SIZE = 4096

# Bytes per element of the cache dtypes engines use; names follow torch's.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The shape of one model's KV cache, independent of how it is sharded.

    With ``use_mla`` the cache holds one latent vector of ``head_size`` elements
    per token and layer, so ``num_kv_heads`` must be 1.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    use_mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVGeometry.{name} must be a positive int, got {value!r}")
        if not isinstance(self.use_mla, bool):  # the handshake's wire type: anything else fails every handshake
            raise ValueError(f"KVGeometry.use_mla must be a bool, got {self.use_mla!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KVGeometry.dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if self.use_mla and self.num_kv_heads != 1:
            raise ValueError(f"MLA geometry holds one latent per token; num_kv_heads must be 1, got {self.num_kv_heads}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def kv_parts(self) -> int:
        """2 for K and V, 1 for an MLA latent."""
        return 1 if self.use_mla else 2

    @property
    def cell_bytes(self) -> int:
        """Bytes of one (token, layer, kv-head) cell, K and V together."""
        return self.kv_parts * self.head_size * self.itemsize


def pp_layer_spans(num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None) -> list[Span]:
    """The layer span of each pipeline stage.

    Without ``partition`` this is vLLM's default split: ``num_layers // pp_size``
    per stage, and the remainder given one each to the stages just before the
    last one (the last stage also runs the LM head).
    """
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if partition is None:
        if pp_size > num_layers:
            raise ValueError(f"pp_size={pp_size} is more pipeline stages than num_layers={num_layers}")
        sizes = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            sizes[-i] += 1
    else:
        sizes = list(partition)
        if len(sizes) != pp_size:
            raise ValueError(f"layer partition {partition} has {len(sizes)} stages, pp_size is {pp_size}")
        negative = [(stage, size) for stage, size in enumerate(sizes) if size < 0]
        if negative:
            stage, size = negative[0]
            raise ValueError(f"layer partition {partition} has a negative entry, {size} (stage {stage}): "
                             f"each stage needs a layer count >= 1")
        if sum(sizes) != num_layers:
            raise ValueError(f"layer partition {partition} sums to {sum(sizes)}, num_layers is {num_layers}")
        if min(sizes) < 1:
            raise ValueError(f"layer partition {partition} gives a stage no layer (stage {sizes.index(0)} has 0)")
    spans, start = [], 0
    for size in sizes:
        spans.append(Span(start, start + size))
        start += size
    return spans


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """How one engine is sharded: ``tp_size`` x ``pp_size`` ranks.

    Ranks are numbered ``pp_rank * tp_size + tp_rank``, as vLLM numbers them.
    ``layer_partition`` is the layers per stage, as ``VLLM_PP_LAYER_PARTITION``
    gives them; None means vLLM's default split.
    """

    tp_size: int = 1
    pp_size: int = 1
    layer_partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be a positive int, got {value!r}")
        if self.tp_size * self.pp_size > MAX_WORLD_SIZE:
            raise ValueError(f"ParallelLayout tp_size={self.tp_size} x pp_size={self.pp_size} is more than "
                             f"{MAX_WORLD_SIZE} ranks")
        if self.layer_partition is not None:
            partition = self.layer_partition
            sizes = None if isinstance(partition, (str, bytes)) or not hasattr(partition, "__iter__") else tuple(partition)
            if sizes is None or any(isinstance(size, bool) or not isinstance(size, int) for size in sizes):
                raise ValueError(f"ParallelLayout.layer_partition must be a sequence of ints (layers per stage), "
                                 f"got {partition!r}")
            object.__setattr__(self, "layer_partition", sizes)
            if len(self.layer_partition) != self.pp_size:
                raise ValueError(
                    f"layer_partition {self.layer_partition} has {len(self.layer_partition)} stages, pp_size is {self.pp_size}"
                )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        if not (0 <= tp_rank < self.tp_size and 0 <= pp_rank < self.pp_size):
            raise ValueError(f"tp_rank={tp_rank}, pp_rank={pp_rank} outside tp_size={self.tp_size}, pp_size={self.pp_size}")
        return pp_rank * self.tp_size + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """``(tp_rank, pp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} outside world_size={self.world_size} (tp={self.tp_size}, pp={self.pp_size})")
        return rank % self.tp_size, rank // self.tp_size

    def check(self, geometry: KVGeometry) -> None:
        """Raise ValueError, naming the numbers, if this layout cannot hold ``geometry``."""
        heads, tp = geometry.num_kv_heads, self.tp_size
        if not geometry.use_mla and heads % tp and tp % heads:
            raise ValueError(
                f"num_kv_heads={heads} is neither divisible by nor a divisor of tp_size={tp}"
            )
        pp_layer_spans(geometry.num_layers, self.pp_size, self.layer_partition)

    def layer_span(self, geometry: KVGeometry, pp_rank: int) -> Span:
        if not 0 <= pp_rank < self.pp_size:  # a negative index would name a stage counted from the last
            raise ValueError(f"pp_rank={pp_rank} outside pp_size={self.pp_size} (tp={self.tp_size})")
        return pp_layer_spans(geometry.num_layers, self.pp_size, self.layer_partition)[pp_rank]

    def spec(self) -> str:
        """The ``tp=..,pp=..`` form the CLI reads."""
        text = f"tp={self.tp_size},pp={self.pp_size}"
        if self.layer_partition is not None:
            text += ",partition=" + ":".join(map(str, self.layer_partition))
        return text
