"""vLLM KV connector for ncclkv: ``NcclKVConnector(KVConnectorBase_V1)``.

Select it with::

    kv_transfer_config = {
        "kv_connector": "NcclKVConnector",
        "kv_connector_module_path": "ncclkv.connector",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_load_failure_policy": "recompute",   # failed loads are recomputed
        "kv_connector_extra_config": {...},      # see NcclKVConfig
    }

vLLM is imported only when ``NcclKVConnector`` is first accessed, so the
typed config and params here stay usable (and testable) without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import NcclKVConfig
from ._params import PrefillIntent, RemotePrefill, parse_params

if TYPE_CHECKING:
    from ._connector import NcclKVConnector

__all__ = ["NcclKVConfig", "NcclKVConnector", "PrefillIntent", "RemotePrefill", "parse_params"]


def __getattr__(name: str) -> Any:
    if name == "NcclKVConnector":
        from ._connector import NcclKVConnector

        return NcclKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
