"""``NcclKVConnector``: vLLM's ``KVConnectorBase_V1`` over ncclkv's transfer engine.

Hook lifecycle (vLLM 0.32, see docs/VLLM_NOTES.md), one instance per role:

scheduler role (engine core)
    set_xfer_handshake_metadata(_pp_aware)  every worker's control address -> EngineRef
    get_num_new_matched_tokens   D: tokens to load for a do_remote_prefill request (async by default)
    update_state_after_alloc     D: a load job over the request's blocks; P: push intent
    build_connector_meta         every step: load / hold / push jobs for the workers
    update_connector_output      finished sends / receives, load errors, the workers' staging events
    request_finished             P: keep the blocks, return the decode side's kv_transfer_params
    take_events                  D: pushed KV stored in / removed from staging, once all workers agree
    has_pending_block_frees      P: out of blocks, wait for a recent hold's free instead of preempting
worker role (one per TP x PP rank; owns a TransferEngine)
    register_kv_caches           detect the cache layout, map layer names, start the engine
    start_load_kv                register holds, start loads (engine.expect)
    wait_for_layer_load          sync loads: wait for this layer only
    save_kv_layer / wait_for_save  push: stream each layer / mark the push complete
    get_finished                 sends done, async loads landed (or failed)
    get_block_ids_with_load_errors  blocks of failed loads: vLLM recomputes them
                                    (use kv_load_failure_policy="recompute"); vLLM's V1 runner
                                    asks before a speculative drafter's forward, so it waits for
                                    the drafter's layers of layer-wise loads (V2: their hooks did)
    get_kv_connector_kv_cache_events  D: this rank's staging events as BlockStored / BlockRemoved
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ._config import NcclKVConfig, engine_role
from ._events import NcclKVEvents, to_vllm_events
from ._metadata import NcclKVMetadata
from ._scheduler import SchedulerSide
from ._stats import NcclKVPromMetrics, NcclKVStats
from ._vllm_env import check_context_parallel, check_kv_cache_groups, check_speculative, rank_info
from ._worker import WorkerSide, layer_index

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["NcclKVConnector"]

log = logging.getLogger("ncclkv.connector")


class NcclKVConnector(KVConnectorBase_V1):
    """P/D KV transfer between tensor/pipeline-parallel vLLM engines (NCCL on GPUs, gloo on CPUs)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        check_speculative(vllm_config)  # both roles: the engine core fails at start, before any worker
        check_context_parallel(vllm_config)
        check_kv_cache_groups(kv_cache_config)
        kv = self._kv_transfer_config
        self.config = NcclKVConfig.from_extra(kv.kv_connector_extra_config)
        self._engine_role = engine_role(kv.kv_role)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if kv.is_kv_consumer and kv.kv_load_failure_policy != "recompute":
                log.warning("ncclkv: kv_load_failure_policy=%r: a failed KV load ends its request with an error; "
                            "set 'recompute' to have vLLM recompute it", kv.kv_load_failure_policy)
            self._scheduler = SchedulerSide(str(kv.engine_id), self.config, kv.is_kv_producer, kv.is_kv_consumer,
                                            vllm_config.cache_config.block_size)
        else:
            self._worker_config = vllm_config

    # ============================== worker role ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            raise RuntimeError("ncclkv: register_kv_caches called twice")
        first = next(iter(kv_caches.values()))
        info = rank_info(self._worker_config, first.dtype, [layer_index(name) for name in kv_caches])
        worker = WorkerSide(info, self.config, self._engine_role)
        worker.register_kv_caches(kv_caches)
        self._worker = worker

    # The hooks run inside vLLM's forward, under torch.inference_mode: tensors the engine makes there
    # (send buffers, index tensors) are used later on its own threads, outside it, where an inference
    # tensor cannot be written. So the engine is always called with inference mode off.
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        with torch.inference_mode(False):
            self._work().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        with torch.inference_mode(False):
            self._work().wait_for_layer_load(self._meta(), layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        with torch.inference_mode(False):
            self._work().save_kv_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        with torch.inference_mode(False):
            self._work().wait_for_save(self._meta())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, NcclKVMetadata):
            with torch.inference_mode(False):
                self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._bound_meta()
        idle = meta is not None and meta.idle
        with torch.inference_mode(False):
            sending, receiving = self._work().get_finished(finished_req_ids, idle=idle)
        return sending or None, receiving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with torch.inference_mode(False):  # a drafter's layer-wise loads are waited for here (scatters)
            return self._work().get_block_ids_with_load_errors(self._bound_meta())

    def get_kv_connector_kv_cache_events(self) -> NcclKVEvents | None:
        """This worker's staging events since the last step (None when there are none)."""
        if self._worker is None:
            return None
        events = self._worker.engine.take_staging_events()
        return NcclKVEvents(to_vllm_events(events)) if events else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.get_stats() if self._worker is not None else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ============================== scheduler role ==============================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        state = scheduler_output.kv_connector_block_state
        manager = self._kv_cache_manager

        def block_ids_of(req_id: str) -> tuple[list[int], ...]:
            found = state.get_block_ids(req_id) if state is not None else None
            if found is None:
                assert manager is not None, "vLLM binds the KV cache manager before scheduling"
                found = manager.get_block_ids(req_id)
            return found

        return self._sched().build_connector_meta(scheduler_output, block_ids_of)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        return self._sched().take_events()

    def has_pending_block_frees(self) -> bool:
        """P: a request finished less than ``free_wait_s`` ago still holds blocks for a transfer: vLLM waits for
        them instead of preempting a running request (``SchedulerSide.has_pending_block_frees``)."""
        return self._sched().has_pending_block_frees()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A load fills the request's own blocks in every group."""
        assert self._kv_cache_config is not None
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp_rank): md for tp_rank, md in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        self._sched().set_handshakes(dict(metadata))

    # ============================== class-level ==============================
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # every paged layout is read as it is (ncclkv.paged)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer / wait_for_layer_load run Python between layers

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return NcclKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return NcclKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ============================== internals ==============================
    def _bound_meta(self) -> NcclKVMetadata | None:
        """This step's metadata for the hooks vLLM may also call with none bound (or another connector's)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return meta if isinstance(meta, NcclKVMetadata) else None

    def _meta(self) -> NcclKVMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, NcclKVMetadata):
            raise TypeError(f"ncclkv: bound connector metadata is {type(meta).__name__}, not NcclKVMetadata")
        return meta

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError(f"ncclkv: worker hook called on a {self.role.name} connector, or before "
                               f"register_kv_caches")
        return self._worker

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError(f"ncclkv: scheduler hook called on a {self.role.name} connector")
        return self._scheduler
