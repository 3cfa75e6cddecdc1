"""The transfer engine, usable without vLLM: one :class:`TransferEngine` per rank."""

from ._config import DEFAULT_LAST_PIECE_BYTES, DEFAULT_PULL_BATCH_BYTES, EngineConfig, EngineRef, Role, peer_id
from ._engine import TransferEngine
from ._staging import BlockTokens, StagingEvent
from ._stats import StatsSnapshot

__all__ = [
    "DEFAULT_LAST_PIECE_BYTES", "DEFAULT_PULL_BATCH_BYTES", "BlockTokens", "EngineConfig", "EngineRef", "Role",
    "StagingEvent", "StatsSnapshot", "TransferEngine", "peer_id",
]
