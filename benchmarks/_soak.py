"""A soak run: many requests of random lengths through a prefill/decode set in this process, resources sampled.

Every engine rank of the set lives in this one process with its real ZMQ
channel and gloo links (as tests/engine does), so one RSS covers the whole
set. Requests run in waves over a fixed pool of blocks, the way an engine
reuses its KV cache; each request is pulled, pushed to a consumer that already
expects it ("push"), or pushed before the consumer expects it ("staged": it
waits in the consumer's staging store). Every landed byte is checked. Two
samples per wave: "staged" once every staged push sits in staging (a moment
the driver waits for, so what it reads there is fixed by the wave's staged
bytes) and "end" once the wave is over (staging must be empty again). What
staging really held at its fullest comes from its store's high-water mark
(``peak_used_bytes``), started anew at the beginning of every wave and read
with the "end" sample. Shared by tests/soak and ``ncclkv bench memory``.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ncclkv.engine import EngineConfig, EngineRef, Role, TransferEngine
from ncclkv.layout import KVGeometry, ParallelLayout, Roi, shard_roi
from ncclkv.paged import CacheLayout
from ncclkv.scenario import PDTopology, ScenarioError
from ncclkv.scenario._kv import check_landed, fill_shard, make_cache

from ._resources import peak_rss_bytes, rss_bytes, staging_peak, staging_usage, wire_pool

__all__ = ["MODES", "SoakConfig", "SoakReport", "SoakRequest", "SoakSample", "plan_requests", "run_soak"]

MODES = ("pull", "push", "staged")
PRODUCER_LAYOUT, PRODUCER_BLOCK = CacheLayout.CPU, 16
CONSUMER_LAYOUT, CONSUMER_BLOCK = CacheLayout.FLASH_NHD, 32
_POLL_S = 0.002  # polling the engines' own bookkeeping (they have no blocking variant); no data waits on it


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """``num_requests`` requests of 1..``max_tokens`` tokens in waves of ``wave_size``; modes drawn uniformly."""

    num_requests: int = 200
    wave_size: int = 8
    max_tokens: int = 256
    geometry: KVGeometry = KVGeometry(num_layers=4, num_kv_heads=4, head_size=64, dtype="bfloat16")
    topology: PDTopology = PDTopology(2, ParallelLayout(1, 1), 2, ParallelLayout(1, 1))
    seed: int = 0
    deadline_s: float = 30.0
    staging_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if min(self.num_requests, self.wave_size, self.max_tokens) < 1 or not self.deadline_s > 0:
            raise ValueError(f"need num_requests, wave_size, max_tokens >= 1 and deadline_s > 0; got "
                             f"{self.num_requests}, {self.wave_size}, {self.max_tokens}, {self.deadline_s}")
        worst = self.wave_size * self.max_tokens * self.geometry.num_layers * self.geometry.num_kv_heads * \
            self.geometry.cell_bytes
        if self.staging_bytes < worst:
            raise ValueError(f"staging_bytes={self.staging_bytes} cannot hold a wave of {self.wave_size} staged "
                             f"requests of {self.max_tokens} tokens ({worst} B)")


@dataclass(frozen=True, slots=True)
class SoakRequest:
    index: int
    prefill: int  # instance
    decode: int
    mode: str  # one of MODES
    num_tokens: int

    @property
    def request_id(self) -> str:
        return f"soak{self.index}"

    @property
    def seed(self) -> int:
        return self.index + 1


@dataclass(frozen=True, slots=True)
class SoakSample:
    requests_done: int
    elapsed_s: float
    phase: str  # "staged" | "end"
    rss_bytes: int
    staging_used: int  # summed over every consumer rank
    staging_reserved: int
    in_flight: int  # requests held or pending in any engine
    wire_cached: int  # free wire buffers kept for reuse, summed over every rank
    wire_bound: int = 0  # what the pools trim themselves to now (KEEP_PEAKS x recent peak out, capped), summed
    staging_peak: int = 0  # the decode ranks' staging high-water marks since the wave began, summed
    staging_peak_rank: int = 0  # the highest of them: what one rank's capacity must hold


@dataclass(frozen=True, slots=True)
class SoakReport:
    config: SoakConfig
    samples: tuple[SoakSample, ...]
    seconds: float
    bytes_received: int
    modes: dict[str, int] = field(default_factory=dict)
    rss_before_bytes: int = 0  # before any engine existed
    peak_rss_bytes: int = 0  # the process's high-water mark (getrusage) at the end

    def phase(self, name: str) -> list[SoakSample]:
        return [s for s in self.samples if s.phase == name]


def plan_requests(cfg: SoakConfig) -> list[SoakRequest]:
    """The run's requests, a function of ``cfg`` alone (its seed)."""
    rng = random.Random(cfg.seed)
    topo = cfg.topology
    return [SoakRequest(i, rng.randrange(topo.num_prefill), rng.randrange(topo.num_decode), rng.choice(MODES),
                        rng.randint(1, cfg.max_tokens)) for i in range(cfg.num_requests)]


@dataclass(slots=True)
class _Rank:
    engine: TransferEngine
    caches: dict[int, torch.Tensor]
    shard: Roi
    finished: dict[str, BaseException | None] = field(default_factory=dict)  # reported, not yet consumed


class _SoakSet:
    """The engines of the set, their block pools, and one wave at a time."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        topo = cfg.topology
        self.prefill: list[list[_Rank]] = []
        self.decode: list[list[_Rank]] = []
        try:
            for instance in range(topo.num_prefill):
                self.prefill.append([])
                self._start(self.prefill[-1], f"prefill{instance}", topo.prefill, "producer")
            for instance in range(topo.num_decode):
                self.decode.append([])
                self._start(self.decode[-1], f"decode{instance}", topo.decode, "consumer")
        except BaseException:
            self.close()
            raise
        self.prefill_refs = [self._ref(f"prefill{i}", topo.prefill, ranks) for i, ranks in enumerate(self.prefill)]
        self.decode_refs = [self._ref(f"decode{i}", topo.decode, ranks) for i, ranks in enumerate(self.decode)]

    def _start(self, ranks: list[_Rank], engine_id: str, layout: ParallelLayout, role: Role) -> None:
        """Start every rank of one engine into ``ranks`` (as they start: close() then finds them all)."""
        cfg, producer = self.cfg, role == "producer"
        cache_layout, block = (PRODUCER_LAYOUT, PRODUCER_BLOCK) if producer else (CONSUMER_LAYOUT, CONSUMER_BLOCK)
        num_blocks = cfg.wave_size * math.ceil(cfg.max_tokens / block)
        dtype = getattr(torch, cfg.geometry.dtype)
        for rank in range(layout.world_size):
            shard = shard_roi(layout, cfg.geometry, rank, 0)
            caches = {layer: make_cache(cache_layout, num_blocks, block, len(shard.heads), cfg.geometry.head_size,
                                        dtype) for layer in shard.layers}
            engine = TransferEngine(EngineConfig(engine_id, rank, layout, cfg.geometry, role=role,
                                                 deadline_s=cfg.deadline_s, staging_bytes=cfg.staging_bytes))
            ranks.append(_Rank(engine, caches, shard))
            engine.register(caches, cache_layout)

    @staticmethod
    def _ref(engine_id: str, layout: ParallelLayout, ranks: list[_Rank]) -> EngineRef:
        return EngineRef(engine_id, layout, tuple(r.engine.address for r in ranks))

    def blocks(self, slot: int, num_tokens: int, block_size: int) -> list[int]:
        """Slot ``slot`` of a wave owns its own run of blocks on every engine, reused wave after wave."""
        per = math.ceil(self.cfg.max_tokens / block_size)
        return list(range(slot * per, slot * per + math.ceil(num_tokens / block_size)))

    def ranks(self) -> Iterable[_Rank]:
        for group in self.prefill + self.decode:
            yield from group

    def close(self) -> None:
        for rank in self.ranks():
            rank.engine.close()

    def usage(self) -> tuple[int, int, int, int, int, int, int]:
        """(staging used, staging reserved, requests in flight, wire buffers cached, their bound), summed over
        every rank, then (staging high-water marks summed, the highest one) over the decode ranks since the
        last :meth:`reset_staging_peaks`."""
        used = reserved = in_flight = wire_cached = wire_bound = 0
        for rank in self.ranks():
            rank_used, rank_reserved = staging_usage(rank.engine)
            used, reserved = used + rank_used, reserved + rank_reserved
            in_flight += rank.engine.num_in_flight
            cached, bound = wire_pool(rank.engine)
            wire_cached, wire_bound = wire_cached + cached, wire_bound + bound
        peaks = [staging_peak(rank.engine) for group in self.decode for rank in group]
        return used, reserved, in_flight, wire_cached, wire_bound, sum(peaks), max(peaks, default=0)

    def reset_staging_peaks(self) -> None:
        """Start every decode rank's staging high-water mark anew from what it holds now."""
        for group in self.decode:
            for rank in group:
                staging_peak(rank.engine, reset=True)

    def received_bytes(self) -> int:
        return sum(rank.engine.stats().bytes_received for group in self.decode for rank in group)

    # -- one wave ---------------------------------------------------------------------
    def run_wave(self, wave: list[SoakRequest], on_staged: Callable[[], None]) -> None:
        slots = {req.index: slot for slot, req in enumerate(wave)}
        cfg = self.cfg

        def dst_blocks(req: SoakRequest) -> list[int]:
            return self.blocks(slots[req.index], req.num_tokens, CONSUMER_BLOCK)

        def expect(req: SoakRequest) -> None:
            for rank in self.decode[req.decode]:
                rank.engine.expect(req.request_id, self.prefill_refs[req.prefill], dst_blocks(req), req.num_tokens,
                                   push=req.mode != "pull")

        for req in wave:  # the "prefill": this request's KV into its producer's blocks
            for rank in self.prefill[req.prefill]:
                blocks = self.blocks(slots[req.index], req.num_tokens, PRODUCER_BLOCK)
                fill_shard(rank.caches, PRODUCER_LAYOUT, cfg.geometry, rank.shard, req.seed, blocks, req.num_tokens)
        for req in wave:
            if req.mode != "staged":
                expect(req)
        for req in wave:
            for rank in self.prefill[req.prefill]:
                blocks = self.blocks(slots[req.index], req.num_tokens, PRODUCER_BLOCK)
                if req.mode == "pull":
                    rank.engine.finish(req.request_id, blocks, req.num_tokens)
                    continue
                rank.engine.start_push(req.request_id, self.decode_refs[req.decode], blocks, req.num_tokens)
                for layer in rank.shard.layers:
                    rank.engine.save_layer(req.request_id, layer)
                rank.engine.finish(req.request_id)
        staged = [req for req in wave if req.mode == "staged"]
        self._collect(staged, sending=True)
        self._await_staging(staged)
        on_staged()
        for req in staged:
            expect(req)
        for req in wave:
            for rank in self.decode[req.decode]:
                rank.engine.wait(req.request_id, cfg.deadline_s)
                bad = check_landed(rank.caches, CONSUMER_LAYOUT, cfg.geometry, rank.shard, req.seed, dst_blocks(req),
                                   req.num_tokens)
                if bad:
                    raise ScenarioError(f"{req.request_id} ({req.mode}, {req.num_tokens} tokens) to decode"
                                        f"{req.decode} rank {rank.engine.config.rank}: layers {bad} differ")
        self._collect(wave, sending=False)
        self._collect([req for req in wave if req.mode != "staged"], sending=True)  # staged: collected above

    def _collect(self, requests: list[SoakRequest], sending: bool) -> None:
        """Wait until every rank involved reported each request done (producers: sent; consumers: landed)."""
        wanted = [(rank, req) for req in requests
                  for rank in (self.prefill[req.prefill] if sending else self.decode[req.decode])]
        deadline = time.monotonic() + self.cfg.deadline_s
        for rank, req in wanted:
            while req.request_id not in rank.finished:
                take = rank.engine.take_finished_sending if sending else rank.engine.take_finished_receiving
                rank.finished.update(take())
                if req.request_id in rank.finished:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{req.request_id} ({req.mode}) not {'sent' if sending else 'received'} by "
                                       f"{rank.engine.config.peer_id} within {self.cfg.deadline_s} s")
                threading.Event().wait(_POLL_S)
            error = rank.finished.pop(req.request_id)
            if error is not None:
                raise error

    def _await_staging(self, staged: list[SoakRequest]) -> None:
        """Wait until each consumer rank's staging holds exactly the staged requests' bytes for it."""
        deadline = time.monotonic() + self.cfg.deadline_s
        for instance, ranks in enumerate(self.decode):
            for rank in ranks:
                per_token = len(rank.shard.layers) * len(rank.shard.heads) * self.cfg.geometry.cell_bytes
                want = sum(per_token * req.num_tokens for req in staged if req.decode == instance)
                while (used := staging_usage(rank.engine)) != (want, want):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{rank.engine.config.peer_id}: staging (used, reserved) {used}, "
                                           f"expected {want} B of staged pushes")
                    threading.Event().wait(_POLL_S)


def run_soak(cfg: SoakConfig, progress: Callable[[str], None] | None = None) -> SoakReport:
    """Run every request of ``cfg`` wave by wave; raise on the first failure or wrong byte."""
    requests = plan_requests(cfg)
    rss_before = rss_bytes()
    samples: list[SoakSample] = []
    soak = _SoakSet(cfg)
    try:
        moved_before, started, done = soak.received_bytes(), time.monotonic(), 0

        def sample(phase: str) -> None:
            samples.append(SoakSample(done, time.monotonic() - started, phase, rss_bytes(), *soak.usage()))

        for first in range(0, len(requests), cfg.wave_size):
            wave = requests[first:first + cfg.wave_size]
            soak.reset_staging_peaks()
            soak.run_wave(wave, lambda: sample("staged"))
            done += len(wave)
            sample("end")
            if progress is not None and (first // cfg.wave_size) % 10 == 0:
                progress(f"soak: {done}/{len(requests)} requests, RSS {samples[-1].rss_bytes / 2**20:.0f} MiB")
        seconds, moved = time.monotonic() - started, soak.received_bytes() - moved_before
    finally:
        soak.close()
    modes = {mode: sum(1 for r in requests if r.mode == mode) for mode in MODES}
    return SoakReport(cfg, tuple(samples), seconds, moved, modes, rss_before, peak_rss_bytes())
