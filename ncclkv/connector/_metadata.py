"""What the scheduler role tells the workers each step, and what workers publish at start-up.

Plain frozen values: vLLM pickles them between processes (scheduler ->
workers; workers -> engine core for the handshake metadata).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from ..engine import BlockTokens, EngineRef
from ..layout import ParallelLayout, SpanSet

__all__ = ["DeclineJob", "HoldJob", "LoadJob", "NcclKVHandshake", "NcclKVMetadata", "PushJob", "engine_ref_from_handshakes"]


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Consumer: receive ``tokens`` of a prefilled request into ``block_ids`` (all the request's blocks).

    ``push``: the producer streamed it on its own (all ``num_tokens`` tokens; those before ``tokens``
    are this engine's own prefix hit, not written);
    ``sync``: loaded inside this step's forward pass, layer by layer.
    """

    req_id: str
    transfer_id: str
    producer: EngineRef
    block_ids: tuple[int, ...]
    tokens: tuple[tuple[int, int], ...]
    num_tokens: int
    push: bool = False
    sync: bool = False
    hold: int = 0  # pull: the producer's number of the hold (RemotePrefill.hold); 0: not named

    def token_set(self) -> SpanSet:
        return SpanSet(self.tokens)


@dataclass(frozen=True, slots=True)
class HoldJob:
    """Producer, pull mode: this step completes the request's prompt; from the end of the step keep its
    blocks for the consumer's pull (registered before vLLM even finishes the request, so a consumer can
    pull while this engine is idle)."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    hold: int = 0  # the hold's number (TransferEngine.finish(..., hold=)), chosen by the scheduler for the params


@dataclass(frozen=True, slots=True)
class PushJob:
    """Producer, push mode: stream the request's layers to ``consumer`` as this step computes them.

    ``blocks``: the prompt's full blocks, which the consumer names in its staging events."""

    req_id: str
    transfer_id: str
    consumer: EngineRef
    block_ids: tuple[int, ...]
    num_tokens: int
    blocks: BlockTokens | None = None


@dataclass(frozen=True, slots=True)
class DeclineJob:
    """Consumer: a request that named ``transfer_id`` ended here without loading it; every worker tells
    the producer's ranks, which free the held blocks instead of keeping them ``hold_s`` (``push``: gives
    back what is staged for it and refuses the rest)."""

    transfer_id: str
    producer: EngineRef
    push: bool = False
    hold: int = 0  # pull: the number of the hold declined (RemotePrefill.hold); 0: not named


@dataclass(frozen=True)
class NcclKVMetadata(KVConnectorMetadata):
    """One step's jobs; always built, possibly empty (vLLM binds it every step)."""

    loads: tuple[LoadJob, ...] = ()
    holds: tuple[HoldJob, ...] = ()
    pushes: tuple[PushJob, ...] = ()
    releases: tuple[str, ...] = ()  # transfer ids of holds whose request ended without a remote decode
    preempted: frozenset[str] = frozenset()
    idle: bool = False  # vLLM scheduled no tokens this step: it steps only to poll the connector
    declines: tuple[DeclineJob, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.loads or self.holds or self.pushes or self.releases or self.preempted or self.declines)


@dataclass(frozen=True)
class NcclKVHandshake(KVConnectorHandshakeMetadata):
    """One worker's identity and control address, gathered by the engine core for the scheduler."""

    engine_id: str
    rank: int
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    layer_partition: tuple[int, ...] | None
    control_addr: str
    incarnation: int = 0  # the worker's engine's channel incarnation (0: not known), into the EngineRef

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp_size, self.pp_size, self.layer_partition)


def engine_ref_from_handshakes(handshakes: dict[tuple[int, int], NcclKVHandshake]) -> EngineRef:
    """Every rank's address as one :class:`EngineRef`; ValueError naming what is missing or inconsistent."""
    if not handshakes:
        raise ValueError("no worker handshake metadata")
    for key, md in handshakes.items():
        if not isinstance(md, NcclKVHandshake):
            # vLLM's MultiConnector hands every sub-connector the first non-None handshake of any of them.
            raise ValueError(f"handshake {key} is {type(md).__name__}, not NcclKVHandshake (vLLM's "
                             f"MultiConnector gives each sub-connector the first handshake any of them made: "
                             f"beside ncclkv, only connectors that make none, such as offloading ones)")
    first = next(iter(handshakes.values()))
    layout = first.layout
    for key, md in handshakes.items():
        if (md.engine_id, md.layout) != (first.engine_id, layout):
            raise ValueError(f"workers disagree: {key} says engine {md.engine_id!r} {md.layout}, "
                             f"another {first.engine_id!r} {layout}")
        if key != (md.pp_rank, md.tp_rank) or md.rank != layout.rank(md.tp_rank, md.pp_rank):
            raise ValueError(f"handshake keyed {key} carries pp_rank={md.pp_rank} tp_rank={md.tp_rank} rank={md.rank}")
    by_rank = {md.rank: md for md in handshakes.values()}
    missing = sorted(set(range(layout.world_size)) - set(by_rank))
    if missing:
        raise ValueError(f"no handshake from ranks {missing} of engine {first.engine_id!r} ({layout})")
    ranks = [by_rank[r] for r in range(layout.world_size)]
    incarnations = tuple(md.incarnation for md in ranks)
    return EngineRef(first.engine_id, layout, tuple(md.control_addr for md in ranks),
                     incarnations if any(incarnations) else ())
