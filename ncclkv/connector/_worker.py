"""The worker role: one :class:`TransferEngine` per vLLM worker, driven by the scheduler's jobs.

Loads (consumer) start in ``start_load_kv`` and progress on the engine's own
threads; async ones are reported by ``get_finished`` once landed, sync ones
are waited for layer by layer in ``wait_for_layer_load``. A failed load is
never half-used: its blocks are reported by ``get_block_ids_with_load_errors``
(and an async one as finished), so vLLM recomputes them. Holds (producer,
pull) are registered in ``wait_for_save`` of the step that completed the
prompt and last until every consumer rank pulled; pushes stream each layer
from ``save_kv_layer``. A request is reported sent only once vLLM finished it
and no send reads its blocks any more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..engine import EngineConfig, Role, StatsSnapshot, TransferEngine
from ..layout import KVGeometry, ParallelLayout, Span, shard_roi
from ..paged import CacheLayout, PagedCacheSpec, SlotMap, detect_layout, gather, scatter
from ._config import NcclKVConfig
from ._cpu_cache import cpu_cache_layout
from ._metadata import LoadJob, NcclKVHandshake, NcclKVMetadata, PushJob
from ._stats import NcclKVStats, stats_delta

__all__ = ["RankInfo", "WorkerSide", "layer_index"]

log = logging.getLogger("ncclkv.connector")


def layer_index(name: str) -> int:
    """The global layer index in a vLLM attention layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"cannot read one layer index from KV cache layer name {name!r}")
    return numbers[0]


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this worker sits in its engine, and what the model's KV looks like."""

    engine_id: str
    tp_rank: int
    pp_rank: int
    layout: ParallelLayout
    geometry: KVGeometry
    block_size: int
    kv_cache_dtype: str = "auto"
    drafter_layers: tuple[int, ...] = ()  # a speculative drafter's layers, numbered after the model's
    # The model's dtype (a torch dtype's name), in which vLLM's attention writes the caches; None: the caches'
    # (they differ with kv_cache_dtype fp8: uint8 caches).
    model_dtype: str | None = None

    @property
    def rank(self) -> int:
        return self.layout.rank(self.tp_rank, self.pp_rank)


@dataclass(slots=True)
class _Step:
    """This worker's part of one step (the metadata vLLM bound): its pushes once started, the layers saved, the
    drafter's layers waited for."""

    meta: NcclKVMetadata
    pushes: list[PushJob] | None = None  # None: not started (no save hook ran yet)
    saved: set[int] = field(default_factory=set)
    waited: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Load:
    job: LoadJob
    started: float
    failed: bool = False


class WorkerSide:
    def __init__(self, info: RankInfo, config: NcclKVConfig, role: Role) -> None:
        self._info, self._config, self._role = info, config, role
        self._engine: TransferEngine | None = None
        self._layers: dict[str, int] = {}  # vLLM layer name -> global layer index
        self._caches: dict[int, tuple[torch.Tensor, PagedCacheSpec]] = {}
        self._blocks_per_id = 1  # the caches' (kernel) blocks per vLLM block id
        self._loads: dict[str, _Load] = {}  # transfer id -> load in flight
        self._sends: dict[str, str] = {}  # transfer id -> request id, held or pushed
        self._dropped: set[str] = set()  # transfer ids of preempted requests: completion not reported
        self._sent: set[str] = set()  # request ids whose sends completed
        self._finished: set[str] = set()  # request ids the scheduler finished (may be reported as sent)
        self._done_recv: set[str] = set()
        self._load_errors: set[int] = set()
        self._step: _Step | None = None  # the latest step's (vLLM binds new metadata every step)
        # A speculative drafter's layers: vLLM runs their hooks once per draft token a step (the first pass writes
        # the step's positions, later ones past them), after the model's; its V1 runner asks for load errors
        # before the drafter's forward, V2 after it.
        self._drafter = frozenset(info.drafter_layers)
        self._stats_base: StatsSnapshot | None = None
        self._transfer_s: list[float] = []

    # -- set-up ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        info = self._info
        if self._engine is not None:
            raise RuntimeError("register_kv_caches called twice")
        layers = {name: layer_index(name) for name in kv_caches}
        if len(set(layers.values())) != len(layers):
            raise ValueError(f"KV cache layer names map to repeated layer indices: {layers}")
        by_index = {layers[name]: tensor for name, tensor in kv_caches.items()}
        cache_layout, kernel_block_size = self._cache_layout(by_index)
        engine = TransferEngine(EngineConfig(
            info.engine_id, info.rank, info.layout, info.geometry, role=self._role,
            device=str(next(iter(by_index.values())).device),
            bind_host=self._config.bind_host, deadline_s=self._config.deadline_s,
            heartbeat_s=self._config.heartbeat_s, staging_bytes=self._config.staging_bytes, hold_s=self._config.hold_s,
            piece_bytes=self._config.piece_bytes, last_piece_bytes=self._config.last_piece_bytes,
            pull_batch_bytes=self._config.pull_batch_bytes,
        ))
        try:
            engine.register(by_index, cache_layout)
        except BaseException:
            engine.close()
            raise
        self._engine, self._layers = engine, layers
        # vLLM may split each of its blocks into kernel blocks its attention backend supports
        # (``kernel_block_sizes``): the caches then hold that many blocks per block id it schedules.
        self._blocks_per_id = info.block_size // kernel_block_size
        self._caches = {i: (t, PagedCacheSpec.from_tensor(t, cache_layout)) for i, t in by_index.items()}
        self._stats_base = engine.stats()
        if self._role == "both" and engine.config.device.startswith("cuda"):
            log.warning("ncclkv: kv_role kv_both on a GPU: one NCCL communicator carries both directions of a link, "
                        "so two kv_both engines pushing to each other at once may block until the deadline (and "
                        "recompute); give prefill engines kv_producer and decode engines kv_consumer")
        log.info("ncclkv: %s rank %d (tp %d, pp %d) registered layers %s as %s at %s", info.engine_id, info.rank,
                 info.tp_rank, info.pp_rank, sorted(by_index), cache_layout.value, engine.address)

    def _cache_layout(self, by_index: Mapping[int, torch.Tensor]) -> tuple[CacheLayout, int]:
        """The layout every layer's cache is read with, and the caches' block size (vLLM's kernel block size,
        a divisor of the block size it schedules); ValueError naming the layers whose caches differ."""
        info = self._info
        heads, head_size = len(shard_roi(info.layout, info.geometry, info.rank, 0).heads), info.geometry.head_size
        configured = self._config.layout()
        found: dict[tuple[CacheLayout, int], list[int]] = {}
        for index in sorted(by_index):
            cache = by_index[index]
            try:
                layout = configured or detect_layout(cache, heads, head_size)
                block_size = PagedCacheSpec.from_tensor(cache, layout).block_size
            except ValueError as err:
                raise ValueError(f"ncclkv: layer {index}'s KV cache: {err}") from err
            found.setdefault((layout, block_size), []).append(index)
        if len(found) > 1:
            readings = "; ".join(f"{layout.name} in blocks of {size} for layers {layers}"
                                 for (layout, size), layers in found.items())
            raise ValueError(f"ncclkv: this rank's KV caches are not all laid out alike ({readings}); ncclkv reads "
                             "every layer of a rank one way (a speculative drafter with its own attention_backend "
                             "or kv_cache_dtype?)")
        ((layout, block_size),) = found
        if info.block_size % block_size:
            raise ValueError(f"ncclkv: the KV caches hold blocks of {block_size} tokens, which do not divide vLLM's "
                             f"block size {info.block_size}")
        # CPU, CPU_KT and CPU_AMX share a shape: vLLM's own cache op says which one its kernels write.
        first = by_index[min(by_index)]
        layout = cpu_cache_layout(layout, first, block_size, head_size, info.kv_cache_dtype,
                                  configured=configured is not None,
                                  model_dtype=None if info.model_dtype is None else getattr(torch, info.model_dtype))
        return layout, block_size

    def _cache_blocks(self, block_ids: Sequence[int]) -> Sequence[int]:
        """vLLM's block ids as the caches' (kernel) block ids: block ``b`` is kernel blocks ``b*r .. b*r+r-1``."""
        ratio = self._blocks_per_id
        if ratio == 1:
            return block_ids
        return [block * ratio + part for block in block_ids for part in range(ratio)]

    def handshake(self) -> NcclKVHandshake | None:
        if self._engine is None:
            return None
        info = self._info
        return NcclKVHandshake(info.engine_id, info.rank, info.tp_rank, info.pp_rank, info.layout.tp_size,
                               info.layout.pp_size, info.layout.layer_partition, self._engine.address,
                               self._engine.incarnation)

    @property
    def engine(self) -> TransferEngine:
        if self._engine is None:
            raise RuntimeError("ncclkv: the KV caches are not registered yet")
        return self._engine

    # -- per step ---------------------------------------------------------------------------
    def start_load_kv(self, meta: NcclKVMetadata) -> None:
        engine = self.engine
        for transfer_id in meta.releases:
            engine.release(transfer_id)  # False: already reported (pulled or expired)
        for decline in meta.declines:
            try:
                engine.decline(decline.transfer_id, decline.producer, push=decline.push, hold=decline.hold)
            except Exception as err:  # the producer frees the blocks after its hold_s anyway
                log.warning("ncclkv: cannot decline transfer %s of %s: %s", decline.transfer_id,
                            decline.producer.engine_id, err)
        for job in meta.loads:
            load = _Load(job, time.monotonic())
            if job.transfer_id in self._loads:  # another request loads it (the scheduler prevents this)
                self._fail(load, ValueError(f"transfer {job.transfer_id!r} is already being loaded for request "
                                            f"{self._loads[job.transfer_id].job.req_id!r}"), owned=False)
                continue
            self._loads[job.transfer_id] = load
            try:
                # A push sends every token; those before the first to load are this engine's own prefix hit
                # (blocks other requests share): they land but are not written.
                engine.expect(job.transfer_id, job.producer, self._cache_blocks(job.block_ids),
                              job.num_tokens if job.push else job.token_set(), push=job.push,
                              keep_tokens=job.token_set().bounds.start if job.push else 0, hold=job.hold)
            except Exception as err:
                self._fail(load, err)

    def wait_for_layer_load(self, meta: NcclKVMetadata, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if layer is not None:
            self._wait_layers(meta, (layer,))

    def _wait_layers(self, meta: NcclKVMetadata, layers: Iterable[int]) -> None:
        """Wait for ``layers`` of this step's layer-wise loads; a drafter's layer once a step, at the first of
        its load hook and the load-error query (whichever vLLM's runner calls first)."""
        step = self._step_of(meta)
        for layer in layers:
            if layer in self._drafter:
                if layer in step.waited:
                    continue
                step.waited.add(layer)
            self._wait_layer(meta, layer)

    def _wait_layer(self, meta: NcclKVMetadata, layer: int) -> None:
        for job in meta.loads:
            load = self._loads.get(job.transfer_id)
            if not job.sync or load is None:
                continue
            try:
                self.engine.wait_layer(job.transfer_id, layer)  # bounded by the engine's progress deadline
            except Exception as err:  # the forward goes on; vLLM discards and recomputes this request
                self._fail(load, err)
                continue
            if self._config.corrupt_for_test:
                self._flip_sign(job, layer)

    def save_kv_layer(self, meta: NcclKVMetadata, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if layer is None:
            return
        step = self._step_of(meta)
        if layer in self._drafter and layer in step.saved:  # the drafter's later passes: past the step's positions
            return
        step.saved.add(layer)
        for push in self._start_pushes(step):
            try:
                self.engine.save_layer(push.transfer_id, layer)
            except Exception as err:  # the push completes with an error; its blocks are still released
                log.error("ncclkv: push of %s layer %d failed: %s", push.req_id, layer, err)

    def wait_for_save(self, meta: NcclKVMetadata) -> None:
        """Hold this step's completed prompts for pulling; mark this step's pushes complete.

        Nothing to wait for: sends run on the engine's threads, and a held or
        pushed request's blocks stay allocated until ``get_finished`` reports it.
        A push's ``finish`` posts the sends its last layer left queued from
        here (their gathers included) unless the link's poster is at them
        already: nothing computes behind that layer."""
        for hold in meta.holds:  # after the forward: every layer of the prompt is in the blocks now
            try:
                self.engine.finish(hold.transfer_id, self._cache_blocks(hold.block_ids), hold.num_tokens,
                                   hold=hold.hold)
                self._sends[hold.transfer_id] = hold.req_id
            except Exception as err:  # nothing held: the decode side's pull fails and it recomputes
                log.error("ncclkv: cannot hold %s (%s): %s", hold.req_id, hold.transfer_id, err)
                self._sent.add(hold.req_id)
        step = self._step_of(meta)
        # No layer hook ran: every layer goes now. vLLM skipped the drafter this step (a sequence near its
        # max_model_len): its layers go as they are, which beats failing the push.
        unsaved = sorted(self._caches) if step.pushes is None else sorted(self._drafter - step.saved)
        if meta.pushes and unsaved:
            for push in self._start_pushes(step):
                for layer in unsaved:
                    self._try(push, lambda tid=push.transfer_id, i=layer: self.engine.save_layer(tid, i))
        for push in step.pushes or ():
            self._try(push, lambda tid=push.transfer_id: self.engine.finish(tid))

    def handle_preemptions(self, meta: NcclKVMetadata) -> None:
        """A preempted request's blocks are about to be reused: drop its hold, fail its sends not announced yet
        (they would read the next request's KV), let the announced ones finish (bounded; past it, those still
        to read the blocks fail, breaking their link). Its recomputed prompt is held again under a new
        transfer id."""
        busy = {tid for tid, req_id in self._sends.items() if req_id in meta.preempted}
        for tid in busy:
            self.engine.reclaim(tid)
        self._dropped |= busy
        # An earlier transfer of theirs that completed counts no more: the recomputed prompt is held (or
        # pushed) anew, and a request aborted before that was never returned as held by the scheduler.
        self._sent -= meta.preempted
        self._finished -= meta.preempted
        deadline = time.monotonic() + float(self.engine.config.deadline_s or 0)
        while busy and time.monotonic() < deadline:
            self._collect_sent()
            busy &= set(self._sends)
            if busy:
                time.sleep(0.001)
        if busy:
            log.error("ncclkv: preempted requests still sending after the deadline: %s; their blocks are reused "
                      "now, a send still to read them fails", sorted(busy))
            for tid in busy:
                self.engine.reclaim(tid, reused=True)

    def get_finished(self, finished_req_ids: set[str], idle: bool = False) -> tuple[set[str], set[str]]:
        engine = self.engine
        if idle:
            self._idle_wait()
        # A dropped transfer (its request preempted) still sending is not the request's any more: it is
        # never reported, so counting its request finished here would keep it in _finished for good.
        ours = {req_id for tid, req_id in self._sends.items() if tid not in self._dropped} | self._sent
        self._finished |= finished_req_ids & ours
        for tid, load in list(self._loads.items()):
            if load.job.req_id in finished_req_ids:  # aborted while loading: stop writing its blocks
                engine.abort(tid)
                del self._loads[tid]
                if not load.job.sync:
                    self._done_recv.add(load.job.req_id)
        for tid, error in engine.take_finished_receiving().items():
            load = self._loads.get(tid)
            if load is None:
                continue
            if error is not None:
                self._fail(load, error)
                continue
            del self._loads[tid]
            self._transfer_s.append(time.monotonic() - load.started)
            if not load.job.sync:
                if self._config.corrupt_for_test:
                    for layer in self._caches:
                        self._flip_sign(load.job, layer)
                self._done_recv.add(load.job.req_id)
        self._collect_sent()
        sending = self._sent & self._finished
        self._sent -= sending
        self._finished -= sending
        receiving, self._done_recv = self._done_recv, set()
        return sending, receiving

    def get_block_ids_with_load_errors(self, meta: NcclKVMetadata | None) -> set[int]:
        """The blocks of loads that failed since the last call. vLLM's V1 runner asks before the drafter's
        forward: the drafter's layers of this step's layer-wise loads are waited for here unless their hooks
        did already (V2), so a failure of theirs is reported in this step with the model's."""
        if meta is not None:
            self._wait_layers(meta, sorted(self._drafter))
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_stats(self) -> NcclKVStats | None:
        if self._engine is None or self._stats_base is None:
            return None
        now = self._engine.stats()
        stats = stats_delta(self._stats_base, now, self._transfer_s)
        self._stats_base, self._transfer_s = now, []
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.close()

    @property
    def num_in_flight(self) -> int:
        """Loads and sends not yet reported to vLLM (0 when nothing leaks)."""
        return len(self._loads) + len(self._sends) + len(self._sent) + len(self._done_recv)

    # -- internals ------------------------------------------------------------------------------
    def _idle_wait(self) -> None:
        """An idle step (see NcclKVConfig.idle_wait_ms): give the GIL to the transfer threads for a while."""
        wait_s = self._config.idle_wait_ms / 1000
        if wait_s <= 0:
            return
        if any(not load.job.sync for load in self._loads.values()):
            self.engine.wait_finished_receiving(wait_s)  # returns as soon as one lands
        elif self._sends:
            time.sleep(wait_s)  # held or pushed blocks: their completion can wait this long

    def _step_of(self, meta: NcclKVMetadata) -> _Step:
        """The step ``meta`` belongs to: each step binds metadata of its own."""
        if self._step is None or self._step.meta is not meta:
            self._step = _Step(meta)
        return self._step

    def _start_pushes(self, step: _Step) -> list[PushJob]:
        if step.pushes is not None:
            return step.pushes
        step.pushes = []
        for push in step.meta.pushes:
            try:
                self.engine.start_push(push.transfer_id, push.consumer, self._cache_blocks(push.block_ids),
                                       push.num_tokens, push.blocks)
            except Exception as err:  # nothing was sent: release the blocks when vLLM finishes the request
                log.error("ncclkv: cannot push %s to %s: %s", push.req_id, push.consumer.engine_id, err)
                self._sent.add(push.req_id)
                continue
            self._sends[push.transfer_id] = push.req_id
            step.pushes.append(push)
        return step.pushes

    def _collect_sent(self) -> None:
        for tid, error in self.engine.take_finished_sending().items():
            req_id = self._sends.pop(tid, None)
            if req_id is None or tid in self._dropped:
                self._dropped.discard(tid)
                continue
            if error is not None:
                log.warning("ncclkv: %s (%s) released without a complete transfer: %s", req_id, tid, error)
            self._sent.add(req_id)

    def _fail(self, load: _Load, error: BaseException, owned: bool = True) -> None:
        """Stop the load and report the blocks it was to fill (vLLM then acts on its
        ``kv_load_failure_policy``: recompute from the first of them, or fail the request). ``owned``: the
        engine transfer is this load's (not another request's that names the same transfer)."""
        if load.failed:
            return
        load.failed = True
        job = load.job
        if owned:
            self.engine.abort(job.transfer_id)  # no write into these blocks after this returns
            self._loads.pop(job.transfer_id, None)
        if not job.sync:
            self._done_recv.add(job.req_id)
        size = self._info.block_size
        for span in job.token_set():
            self._load_errors.update(job.block_ids[i] for i in range(span.start // size, (span.stop - 1) // size + 1))
        log.warning("ncclkv: load of %s (%s) failed; its blocks are reported to vLLM, whose kv_load_failure_policy "
                    "recomputes or fails it: %s", job.req_id, job.transfer_id, error)

    @staticmethod
    def _try(push: PushJob, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as err:  # the engine completes the push with an error; its blocks are released
            log.error("ncclkv: push of %s: %s", push.req_id, err)

    def _flip_sign(self, job: LoadJob, layer: int) -> None:
        """TEST-ONLY (corrupt_for_test): flip the sign bit of every loaded value of ``layer``."""
        cache, spec = self._caches[layer]
        slots = SlotMap(self._cache_blocks(job.block_ids), spec.block_size)
        heads = Span(0, spec.num_kv_heads)
        for span in job.token_set():
            wire = torch.empty(spec.wire_shape(len(span), len(heads)), dtype=cache.dtype, device=cache.device)
            gather(cache, spec, slots, span, heads, wire)
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[wire.element_size()]
            flipped = wire.view(bits) ^ torch.tensor(torch.iinfo(bits).min, dtype=bits)
            scatter(flipped.view(cache.dtype), cache, spec, slots, span, heads)

