"""Drive NcclKVConnector's two roles the way vLLM does, without a model or an engine loop.

An :class:`EngineSim` is one single-rank engine: vLLM's real ``Scheduler``
(which builds the scheduler-role connector through vLLM's connector
factory), a worker-role connector over real paged CPU caches with a real
TransferEngine (ZMQ + gloo), and a stand-in model. Each :meth:`step` runs the
worker hooks in vLLM's order (docs/VLLM_NOTES.md "One step, worker side")
and feeds the result back through ``Scheduler.update_from_output``.

The stand-in model writes, for each computed token, a KV that is a fixed
function of (layer, token id, position), with vLLM's own CPU cache-write op
(so the cache holds exactly what vLLM's attention would read); before
"attention" it reads back every context token of the request and records
any that differ from that function (:attr:`EngineSim.mismatches`); its
sampled token is a function of the KV it read. So a wrong, missing or
corrupted load shows up both as a mismatch and as a different output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         SpeculativeConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from ncclkv.connector import NcclKVConnector
from ncclkv.connector._cpu_cache import cpu_cache_layout
from ncclkv.layout import Span
from ncclkv.paged import CacheLayout, PagedCacheSpec, SlotMap, gather

__all__ = ["EngineSim", "Finished", "expected_kv", "make_prompts"]

BLOCK_SIZE = 32
NUM_KV_HEADS, HEAD_SIZE = 4, 64  # the tiny Llama of ncclkv._vllm_model
VOCAB = 512
_ids = count()
init_none_hash(sha256)


def make_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def expected_kv(layer: int, token_ids: list[int], start: int) -> torch.Tensor:
    """The stand-in model's KV of tokens at positions start.. in wire form [2, T, H, D] (exact in float32)."""
    ids = torch.tensor(token_ids, dtype=torch.float32)
    pos = torch.arange(start, start + len(token_ids), dtype=torch.float32)
    base = torch.remainder(ids * 31 + pos * 7 + layer * 101, 1000)  # [T]
    part = torch.tensor([0.0, 500.0]).view(2, 1, 1, 1)
    offs = torch.arange(NUM_KV_HEADS * HEAD_SIZE, dtype=torch.float32).view(1, 1, NUM_KV_HEADS, HEAD_SIZE) / 8192
    return (base.view(1, -1, 1, 1) + part + offs).contiguous()


def make_vllm_config(name: str, model_dir: Path, kv_role: str, extra: Mapping[str, Any] | None = None, *,
                     max_num_batched_tokens: int = 512, prefix_caching: bool = True, policy: str = "recompute",
                     speculative: Mapping[str, Any] | None = None) -> VllmConfig:
    """An engine's config with ncclkv as its connector (``speculative``: a SpeculativeConfig's arguments)."""
    model = ModelConfig(model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=512)
    parallel = ParallelConfig()
    return VllmConfig(
        model_config=model,
        parallel_config=parallel,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=512, enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NcclKVConnector", kv_connector_module_path="ncclkv.connector", kv_role=kv_role,
            kv_connector_extra_config=dict(extra or {}), kv_load_failure_policy=policy,
            engine_id=f"{name}-{next(_ids)}"),
        speculative_config=None if speculative is None else SpeculativeConfig(
            target_model_config=model, target_parallel_config=parallel, **speculative),
        device_config=DeviceConfig("cpu"),
    )


@dataclass(frozen=True, slots=True)
class Finished:
    token_ids: tuple[int, ...]
    finish_reason: str
    kv_transfer_params: dict[str, Any] | None


@dataclass
class EngineSim:
    """One engine: real scheduler + scheduler-role connector, worker-role connector, paged caches."""

    name: str
    vllm_config: VllmConfig
    scheduler: Scheduler
    worker: NcclKVConnector
    caches: dict[str, torch.Tensor]
    # The last layer is a drafter's, its forward run this many times a step (vLLM: once per draft token; only
    # the first writes this step's positions): 0, no drafter.
    drafter_passes: int = 0
    skip_drafter: bool = False  # vLLM skips the drafter for a step (a sequence near the drafter's max_model_len)
    finished: dict[str, Finished] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    computed: dict[str, int] = field(default_factory=dict)  # tokens the stand-in model computed, per request
    load_errors: set[int] = field(default_factory=set)
    stats: list[dict[str, Any]] = field(default_factory=list)
    # The caches as vLLM's GPU model runner makes them (a KVCacheLayout name; see build), else None: the CPU's.
    gpu_layout: str | None = None

    @classmethod
    def build(cls, name: str, model_dir: Path, kv_role: str, extra: Mapping[str, Any] | None = None, *,
              num_blocks: int = 64, max_num_batched_tokens: int = 512, prefix_caching: bool = True,
              policy: str = "recompute", speculative: Mapping[str, Any] | None = None,
              gpu_layout: str | None = None, kernel_block_size: int = BLOCK_SIZE) -> EngineSim:
        """``gpu_layout`` (a vLLM ``KVCacheLayout`` name, e.g. ``BLNHC``): the caches are made by vLLM's own
        ``allocate_kv_cache``, in blocks of ``kernel_block_size``, as its GPU model runner makes them, and
        written and read as its GPU backends do (K then V per token); ncclkv is told ``cache_layout: packed``,
        since on the CPU it would take them for the CPU backend's."""
        if gpu_layout is not None:
            extra = {**(extra or {}), "cache_layout": CacheLayout.PACKED.value}
        config = make_vllm_config(name, model_dir, kv_role, extra, max_num_batched_tokens=max_num_batched_tokens,
                                  prefix_caching=prefix_caching, policy=policy, speculative=speculative)
        model = config.model_config
        spec = config.speculative_config
        # An EAGLE-like drafter: one more layer, numbered after the model's, in its KV cache group.
        drafter = spec is not None and spec.uses_draft_kv_cache()
        names = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_total_num_hidden_layers() + drafter)]
        attention = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                      dtype=torch.float32)
        groups = [KVCacheGroupSpec(names, attention)]
        if gpu_layout is None:
            kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
            storage = torch.full((len(names), num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE), -1.0)
            caches = {n: storage[i] for i, n in enumerate(names)}  # views of one buffer, layer-major ("LBHNC")
        else:
            config.cache_config.kv_cache_layout = gpu_layout
            kv_cache_config = get_kv_cache_config_from_groups(config, groups,
                                                              num_blocks * len(names) * attention.page_size_bytes)
            caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[gpu_layout],
                                       [kernel_block_size])
            for cache in caches.values():
                cache.fill_(-1.0)
        config.cache_config.num_gpu_blocks = num_blocks
        # The worker side first, as in vLLM: the caches are registered before the scheduler exists.
        worker = NcclKVConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        worker.register_kv_caches(caches)
        scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                              structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE)
        handshake = worker.get_handshake_metadata()
        scheduler.connector.set_xfer_handshake_metadata_pp_aware({} if handshake is None else {(0, 0): handshake})
        return cls(name, config, scheduler, worker, caches, spec.num_speculative_tokens if drafter and spec else 0,
                   gpu_layout=gpu_layout)

    # -- driving ---------------------------------------------------------------------------
    @property
    def connector(self) -> NcclKVConnector:
        return self.scheduler.connector  # type: ignore[return-value]

    @property
    def ref(self) -> dict[str, Any]:
        ref = self.connector._sched().engine_ref
        assert ref is not None
        return ref.to_dict()

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None) -> None:
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params is not None else None)
        request = Request(req_id, list(prompt), sampling, None,
                          block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def preempt(self, req_id: str) -> None:
        request = self.scheduler.requests[req_id]
        self.scheduler.running.remove(request)
        self.scheduler._preempt_request(request, time.monotonic())

    def step(self) -> None:
        so = self.scheduler.schedule()
        with torch.inference_mode():  # as vLLM's model runner: tensors made in the hooks are inference tensors
            output = self._worker_step(so)
        for outputs in self.scheduler.update_from_output(so, output).values():
            for out in outputs.outputs:
                assert out.request_id not in self.finished, f"{out.request_id} produced output after finishing"
                tokens = self._partial.setdefault(out.request_id, [])
                tokens.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    del self._partial[out.request_id]
                    self.finished[out.request_id] = Finished(tuple(tokens), str(out.finish_reason),
                                                             out.kv_transfer_params)

    def _worker_step(self, so: Any) -> ModelRunnerOutput:
        """The worker hooks of one step, in vLLM's order (kv_connector_model_runner_mixin)."""
        worker = self.worker
        worker.handle_preemptions(so.kv_connector_metadata)
        worker.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            worker.start_load_kv(None)  # type: ignore[arg-type]
        jobs = self._jobs(so)
        model_layers = list(self.caches.items())[:len(self.caches) - bool(self.drafter_passes)]
        sampled = self._forward(jobs, model_layers)
        if not so.has_sync_kv_loads:
            worker.start_load_kv(None)  # type: ignore[arg-type]
        if not self.drafter_passes:  # with a drafter, vLLM defers wait_for_save past the drafter's forward
            worker.wait_for_save()
        results = worker.get_transfer_results(so.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        self.load_errors |= invalid
        stats = worker.get_kv_connector_stats()
        if stats is not None:
            self.stats.append(stats.data)
        events = worker.get_kv_connector_kv_cache_events()
        if self.drafter_passes:
            drafter = list(self.caches.items())[-1:]
            for done in range(0 if self.skip_drafter else self.drafter_passes):  # once per draft token
                self._forward(jobs if done == 0 else [], drafter)  # later passes write past these positions
            worker.wait_for_save()
        worker.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None, finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving, invalid_block_ids=invalid, kv_connector_stats=stats,
                kv_cache_events=events),
        )

    def run(self, until: Callable[[], bool], *, timeout_s: float = 30.0, also: tuple[EngineSim, ...] = ()) -> None:
        """Step this engine (and ``also``) until ``until()`` holds; fail after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, f"{self.name}: condition not reached in {timeout_s}s"
            self.step()
            for other in also:
                other.step()

    def outputs(self, req_ids: list[str]) -> list[tuple[int, ...]]:
        return [self.finished[r].token_ids for r in req_ids]

    @property
    def idle(self) -> bool:
        """Nothing left: no request in the scheduler (held ones included), nothing in flight anywhere."""
        return (not self.scheduler.requests and self.worker._work().num_in_flight == 0
                and self.worker._work().engine.num_in_flight == 0
                and self.connector._sched().num_tracked_requests == 0)

    def close(self) -> None:
        self.worker.shutdown()

    # -- the stand-in model -------------------------------------------------------------------
    def __post_init__(self) -> None:
        self._partial: dict[str, list[int]] = {}
        first = next(iter(self.caches.values()))
        if self.gpu_layout is None:
            layout = cpu_cache_layout(CacheLayout.CPU, first, BLOCK_SIZE, HEAD_SIZE)  # the CPU layout vLLM writes
            self._spec = PagedCacheSpec.from_tensor(first, layout)
            self._isa = _get_attn_isa(torch.float32, BLOCK_SIZE, HEAD_SIZE, "auto")

    def _write(self, cache: torch.Tensor, kv: torch.Tensor, positions: range, slots: SlotMap) -> None:
        """Write ``kv`` ([2, T, H, D]) at ``positions`` the way vLLM's attention backend of these caches does."""
        if self.gpu_layout is None:
            where = torch.tensor([slots.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions])
            keys, values = cache.view(-1, NUM_KV_HEADS, 2 * BLOCK_SIZE, HEAD_SIZE).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(kv[0], kv[1], keys, values, where, self._isa, k_scale=1.0,
                                           v_scale=1.0, kv_cache_dtype="auto")
            return
        # vLLM's GPU backends (flash_attn.py do_kv_cache_update): K and V views [blocks, tokens, heads, D] of the
        # [B, H, N, 2*D] cache; reshape_and_cache_flash stores token i at its slot in the kernel blocks.
        keys, values = cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
        for i, (block, offset) in enumerate(self._kernel_slots(cache, positions, slots)):
            keys[block, offset], values[block, offset] = kv[0, i], kv[1, i]

    def _read(self, cache: torch.Tensor, stop: int, slots: SlotMap) -> torch.Tensor:
        """What attention reads of positions [0, stop), as [2, stop, H, D]."""
        if self.gpu_layout is None:
            return gather(cache, self._spec, slots, Span(0, stop), Span(0, NUM_KV_HEADS),
                          torch.empty(2, stop, NUM_KV_HEADS, HEAD_SIZE))
        keys, values = cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
        where = self._kernel_slots(cache, range(stop), slots)
        return torch.stack([torch.stack([part[block, offset] for block, offset in where]) for part in (keys, values)])

    @staticmethod
    def _kernel_slots(cache: torch.Tensor, positions: range, slots: SlotMap) -> list[tuple[int, int]]:
        """(kernel block, offset) of each position: vLLM's block b holds kernel blocks b*r .. b*r+r-1."""
        kernel = cache.size(2)
        ratio = BLOCK_SIZE // kernel
        return [(slots.block_ids[p // BLOCK_SIZE] * ratio + p % BLOCK_SIZE // kernel, p % kernel) for p in positions]

    def _jobs(self, so: Any) -> list[tuple[str, Any, int, int, SlotMap, list[int]]]:
        """What the stand-in model computes this step: (request id, request, first position, tokens, slots, ids)."""
        jobs = []
        for req_id, num in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - num  # the scheduler already advanced it
            (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            tokens = list(request.all_token_ids)
            # Draft tokens (speculative decoding) are scheduled past the known ones: the stand-in computes only
            # the known ones, and its one sampled token rejects every draft.
            num = min(num, len(tokens) - start)
            jobs.append((req_id, request, start, num, SlotMap(block_ids, BLOCK_SIZE), tokens))
            self.computed[req_id] = self.computed.get(req_id, 0) + num
        return jobs

    def _forward(self, jobs: list[tuple[str, Any, int, int, SlotMap, list[int]]],
                 layers: list[tuple[str, torch.Tensor]]) -> dict[str, list[int]]:
        """The stand-in model over ``layers`` (name, cache): writes the jobs' KV, runs the layer hooks, checks
        every loaded token; samples from the last layer."""
        sampled: dict[str, list[int]] = {}
        indices = {name: i for i, name in enumerate(self.caches)}
        for name, cache in layers:
            layer = indices[name]
            for req_id, request, start, num, slots, tokens in jobs:  # this step's KV, written before the layer hooks
                self._write(cache, expected_kv(layer, tokens[start:start + num], start), range(start, start + num),
                            slots)
            self.worker.wait_for_layer_load(name)
            for req_id, request, start, num, slots, tokens in jobs:  # "attention": read the whole context
                stop = start + num
                got = self._read(cache, stop, slots)
                bad = (got != expected_kv(layer, tokens[:stop], 0)).any(dim=(0, 2, 3)).nonzero().flatten()
                if len(bad):
                    self.mismatches.append(f"{req_id} layer {layer}: {len(bad)} tokens, first at {int(bad[0])}")
                if name == layers[-1][0] and stop >= request.num_tokens:  # the prompt is done: sample
                    sampled[req_id] = [2 + int(got.double().sum().item() * 1000) % (VOCAB - 2)]
            self.worker.save_kv_layer(name, cache, None)
        return sampled
