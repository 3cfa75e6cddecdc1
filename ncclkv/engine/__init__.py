"""The transfer engine, usable without vLLM: one :class:`TransferEngine` per rank."""

from ._caches import CacheCopier
from ._config import EngineConfig, EngineRef, Role, peer_id
from ._engine import TransferEngine
from ._stats import StatsSnapshot

__all__ = ["CacheCopier", "EngineConfig", "EngineRef", "Role", "StatsSnapshot", "TransferEngine", "peer_id"]
