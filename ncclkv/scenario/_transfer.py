"""Scenario ``transfer``: prefill engines stream KV to decode engines through the transfer engine.

Every rank is one engine rank of a prefill/decode set (:class:`PDTopology`,
given by the launch scripts' --prefill/--decode options). Request ``i`` goes
from prefill instance ``i % P`` to decode instance ``(i // P) % D``, so every
pair of instances carries traffic. Producers write each request's
deterministic KV into their paged caches (vLLM CPU layout, block 16) and
either hold it for pulling or push it layer by layer; consumers receive into
caches in vLLM 0.32's GPU view (K and V packed per token) with block 32 and check every byte (--mla: the
MLA layout on both sides). Control addresses travel
through the launcher's TCPStore; so do the per-rank results that rank 0
prints as one table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

import torch

from .._timeout import MAX_TIMEOUT_S, check_timeout
from ..auth import load_channel_auth
from ..engine import EngineConfig, EngineRef, TransferEngine
from ..errors import TransferTimeout
from ..launch import LaunchInfo
from ..layout import KVGeometry, ParallelLayout, Roi, shard_roi
from ..paged import CacheLayout
from ._common import checked_topology, resolve_bind_host, resolve_device, sized
from ._kv import check_landed, fill_shard, make_cache
from ._registry import ScenarioError, report
from ._rendezvous import StoreRendezvous
from ._topology import PDTopology, RankPlace

__all__ = ["HELP", "TransferConfig", "TransferRun", "add_arguments", "check", "check_json_out", "check_kill",
           "config_from_args", "pair_of", "run", "summary_json", "transfer_on_rank"]

HELP = "prefill engines send KV to decode engines (pull or push), checked byte-exact on every decode rank"
PRODUCER_LAYOUT, PRODUCER_BLOCK = CacheLayout.CPU, 16
CONSUMER_LAYOUT, CONSUMER_BLOCK = CacheLayout.PACKED, 32  # vLLM 0.32's GPU view
# (--requests, --max-tokens) when not given, without and with --small
_SIZES, _SMALL_SIZES = (16, 512), (4, 80)
_KV_HEADS = 4  # without --mla, when not given (--mla: 1)


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """The requests of one run; request ``i`` has ``tokens[i]`` tokens and seed ``i + 1``."""

    geometry: KVGeometry
    tokens: tuple[int, ...]
    mode: str = "pull"
    deadline_s: float = 10.0
    kill_rank: int | None = None
    # One untimed request per (prefill, decode) pair before the timed window, so that links opened lazily by
    # the first request are open when it starts: without it a P x D set pays P x D link creations inside it.
    warmup: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("pull", "push"):
            raise ValueError(f"mode must be pull or push, got {self.mode!r}")
        if not self.tokens or min(self.tokens) < 1:
            raise ValueError(f"every request needs >= 1 token, got {self.tokens}")
        check_timeout("deadline_s", self.deadline_s)

    @property
    def run_deadline_s(self) -> float:
        """How long the whole run's waits (every send done, every rank finished) may take: three deadlines."""
        return min(3 * self.deadline_s, MAX_TIMEOUT_S)

    def blocks(self, request: int, block_size: int) -> list[int]:
        """The block ids of ``request`` on a side with ``block_size``: its own contiguous run."""
        per = math.ceil(max(self.tokens) / block_size)
        return list(range(request * per, (request + 1) * per))

    def num_blocks(self, block_size: int, num_prefill: int = 0) -> int:
        """Blocks a cache needs: every request's run, and with ``warmup`` one more run per prefill instance
        (``num_prefill``) for its warm-up requests."""
        runs = len(self.tokens) + (num_prefill if self.warmup else 0)
        return runs * math.ceil(max(self.tokens) / block_size)

    @property
    def warmup_tokens(self) -> int:
        """Tokens of each warm-up request: the shortest request's (it opens the links; its bytes do not matter)."""
        return min(self.tokens)

    def warmup_blocks(self, prefill: int, block_size: int) -> list[int]:
        """The blocks of prefill ``prefill``'s warm-up requests, on either side: past every real request's."""
        return self.blocks(len(self.tokens) + prefill, block_size)[:math.ceil(self.warmup_tokens / block_size)]


def pair_of(request: int, topology: PDTopology) -> tuple[int, int]:
    """(prefill instance, decode instance) of ``request``."""
    return request % topology.num_prefill, (request // topology.num_prefill) % topology.num_decode


def _engine_id(role: str, instance: int) -> str:
    return f"{role}{instance}"


def _refs(topology: PDTopology, addresses: list[str]) -> dict[tuple[str, int], EngineRef]:
    """Every instance's EngineRef from the global ranks' published control addresses."""
    refs, rank = {}, 0
    for role, count, layout in (("prefill", topology.num_prefill, topology.prefill),
                                ("decode", topology.num_decode, topology.decode)):
        for instance in range(count):
            refs[(role, instance)] = EngineRef(_engine_id(role, instance), layout,
                                               tuple(addresses[rank:rank + layout.world_size]))
            rank += layout.world_size
    return refs


def _wait_sent(engine: TransferEngine, requests: list[str], deadline_s: float) -> None:
    """Poll until every request this producer rank holds or pushed was sent (or failed: raise it)."""
    pending, deadline = set(requests), time.monotonic() + deadline_s
    while pending:
        for request_id, error in engine.take_finished_sending().items():
            if error is not None:
                raise error
            pending.discard(request_id)
        if pending and time.monotonic() > deadline:
            raise TransferTimeout(f"requests {sorted(pending)} not sent within {deadline_s} s")
        if pending:
            time.sleep(0.002)  # polling the engine's own bookkeeping; no data waits on this


def _warmup_id(prefill: int, decode: int) -> str:
    return f"warmup-p{prefill}-d{decode}"


def _warm_up(engine: TransferEngine, place: RankPlace, topology: PDTopology, cfg: TransferConfig,
             refs: dict[tuple[str, int], EngineRef], caches: dict[int, torch.Tensor], cache_layout: CacheLayout,
             shard: Roi, block: int) -> None:
    """One request per (prefill, decode) pair, as the run sends them (pull or push), before the timed window:
    each pair's links open here, not in the window. The landed bytes are checked as the run's are."""
    n, seed = cfg.warmup_tokens, 1_000_000  # a seed no real request has (request i has seed i + 1)
    if place.role == "prefill":
        blocks = cfg.warmup_blocks(place.instance, block)
        fill_shard(caches, cache_layout, cfg.geometry, shard, seed + place.instance, blocks, n)
        ids = [_warmup_id(place.instance, decode) for decode in range(topology.num_decode)]
        for decode, request_id in enumerate(ids):
            if cfg.mode == "pull":
                engine.finish(request_id, blocks, n)
            else:
                engine.start_push(request_id, refs[("decode", decode)], blocks, n)
                for layer in shard.layers:
                    engine.save_layer(request_id, layer)
                engine.finish(request_id)
        _wait_sent(engine, ids, cfg.run_deadline_s)
        return
    for prefill in range(topology.num_prefill):
        engine.expect(_warmup_id(prefill, place.instance), refs[("prefill", prefill)],
                      cfg.warmup_blocks(prefill, block), n, push=cfg.mode == "push")
    for prefill in range(topology.num_prefill):
        engine.wait(_warmup_id(prefill, place.instance))
        bad = check_landed(caches, cache_layout, cfg.geometry, shard, seed + prefill,
                           cfg.warmup_blocks(prefill, block), n)
        if bad:
            raise ScenarioError(f"{place}: warm-up request from prefill[{prefill}] differs in layers {bad}")


def _run_rank(info: LaunchInfo, place: RankPlace, topology: PDTopology, cfg: TransferConfig, device: torch.device,
              bind_host: str | None, rendezvous: StoreRendezvous) -> list[dict[str, object]]:
    """One rank's part; returns every rank's numbers (place, bytes, seconds, requests, tensors)."""
    producer = place.role == "prefill"
    layout: ParallelLayout = topology.prefill if producer else topology.decode
    engine_rank = layout.rank(place.tp_rank, place.pp_rank)
    engine = TransferEngine(EngineConfig(
        _engine_id(place.role, place.instance), engine_rank, layout, cfg.geometry,
        role="producer" if producer else "consumer", device=str(device), bind_host=bind_host,
        deadline_s=cfg.deadline_s))
    try:
        shard: Roi = shard_roi(layout, cfg.geometry, engine_rank, 0)
        cache_layout, block = (PRODUCER_LAYOUT, PRODUCER_BLOCK) if producer else (CONSUMER_LAYOUT, CONSUMER_BLOCK)
        if cfg.geometry.use_mla:
            cache_layout = CacheLayout.MLA  # one latent per token, on both sides
        dtype = getattr(torch, cfg.geometry.dtype)
        caches = {layer: make_cache(cache_layout, cfg.num_blocks(block, topology.num_prefill), block,
                                    len(shard.heads), cfg.geometry.head_size, dtype, device) for layer in shard.layers}
        engine.register(caches, cache_layout)
        refs = _refs(topology, rendezvous.exchange(engine.address))
        mine = [i for i in range(len(cfg.tokens))
                if pair_of(i, topology)[0 if producer else 1] == place.instance]
        if producer:  # the KV "prefill" computed, before anyone measures the transfer
            for i in mine:
                fill_shard(caches, cache_layout, cfg.geometry, shard, i + 1, cfg.blocks(i, block), cfg.tokens[i])
        if cfg.warmup:
            _warm_up(engine, place, topology, cfg, refs, caches, cache_layout, shard, block)
        before = engine.stats()  # the run's numbers leave the warm-up's bytes and tensors out
        # The timed window starts here on every rank: a consumer that woke 50 ms late (the store's usual
        # polling backoff) would leave a push's first 50 ms out of its window.
        rendezvous.exchange("filled", name="filled", start_line=True)
        started = time.monotonic()
        if producer:
            for i in mine:
                blocks, n = cfg.blocks(i, block), cfg.tokens[i]
                if cfg.mode == "pull":
                    engine.finish(f"req{i}", blocks, n)
                else:
                    engine.start_push(f"req{i}", refs[("decode", pair_of(i, topology)[1])], blocks, n)
                    for layer in shard.layers:
                        engine.save_layer(f"req{i}", layer)
                        if info.rank == cfg.kill_rank:
                            os._exit(9)  # a producer dies mid-request: its consumers must report it
                    engine.finish(f"req{i}")
            _wait_sent(engine, [f"req{i}" for i in mine], cfg.run_deadline_s)
        else:
            for i in mine:
                producer_ref = refs[("prefill", pair_of(i, topology)[0])]
                engine.expect(f"req{i}", producer_ref, cfg.blocks(i, block), cfg.tokens[i], push=cfg.mode == "push")
            for i in mine:
                engine.wait(f"req{i}")
            seconds = time.monotonic() - started
            for i in mine:
                bad = check_landed(caches, cache_layout, cfg.geometry, shard, i + 1, cfg.blocks(i, block),
                                   cfg.tokens[i])
                if bad:
                    raise ScenarioError(f"rank {info.rank} ({place}): request req{i} differs in layers {bad}")
        if producer:
            seconds = time.monotonic() - started
        stats = engine.stats()
        received = stats.bytes_received - before.bytes_received
        mine_result = {"place": str(place), "bytes": received or stats.bytes_sent - before.bytes_sent,
                       "seconds": seconds, "requests": len(mine),
                       "tensors": (stats.tensors_received - before.tensors_received)
                       or stats.tensors_sent - before.tensors_sent}
        results = [json.loads(text) for text in rendezvous.exchange(json.dumps(mine_result), name="result")]
        rendezvous.finish()  # nobody closes a link while a peer still reads from it
        return results
    finally:
        engine.close()


def transfer_on_rank(info: LaunchInfo, topology: PDTopology, cfg: TransferConfig, device: torch.device,
                     bind_host: str | None) -> list[dict[str, object]]:
    """This rank's part of the whole set, with the job's rendezvous; returns every rank's numbers.

    A failure here is reported to every other rank (their waits end at once) and raised.
    """
    rendezvous = StoreRendezvous(info, prefix="ncclkv/transfer", deadline_s=cfg.run_deadline_s)
    try:
        return _run_rank(info, topology.place(info.rank), topology, cfg, device, bind_host, rendezvous)
    except BaseException as exc:
        rendezvous.report_failure(f"{type(exc).__name__}: {exc}")
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=None,
                        help=f"requests in all (default {_SIZES[0]}; --small: {_SMALL_SIZES[0]})")
    parser.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    parser.add_argument("--kv-heads", type=int, default=None, help=f"default {_KV_HEADS}; 1 with --mla")
    parser.add_argument("--head-size", type=int, default=64, help="default 64 (--mla: the latent size)")
    parser.add_argument("--dtype", default="bfloat16", help="KV dtype, a torch name (default bfloat16)")
    parser.add_argument("--mla", action="store_true", help="one latent per token (--kv-heads 1)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"request lengths vary up to this (default {_SIZES[1]}; --small: {_SMALL_SIZES[1]})")
    parser.add_argument("--mode", choices=("pull", "push"), default="pull",
                        help="pull: decode ranks ask for held KV; push: prefill ranks send each layer as saved "
                        "(default pull)")
    parser.add_argument("--kill-rank", type=int, default=None, help="this prefill rank dies after its first saved layer (push)")
    parser.add_argument("--warmup", action="store_true",
                        help="send one untimed request per prefill/decode pair first, so the timed window does not "
                        "include opening the links (for benchmarks)")
    parser.add_argument("--json-out", default=None, metavar="PATH",
                        help="rank 0 also writes the summary as JSON to PATH (for benchmarks)")


def check_kill(cfg: TransferConfig, topology: PDTopology, world_size: int) -> None:
    """``--kill-rank`` must name a prefill rank that pushes a request, else nothing is injected and the run
    would pass as if it had been (ValueError naming the values)."""
    rank = cfg.kill_rank
    if rank is None:
        return
    if cfg.mode != "push":
        raise ValueError(f"--kill-rank {rank} needs --mode push (the rank dies after its first saved layer)")
    if not 0 <= rank < world_size or topology.place(rank).role != "prefill":
        raise ValueError(f"--kill-rank {rank} is not a prefill rank of {topology} ({world_size} ranks)")
    instance = topology.place(rank).instance
    if not any(pair_of(i, topology)[0] == instance for i in range(len(cfg.tokens))):
        raise ValueError(f"--kill-rank {rank}: prefill[{instance}] pushes none of the {len(cfg.tokens)} requests")


def check_json_out(path: str | None, rank: int) -> None:
    """Rank 0 writes ``--json-out`` once every rank has finished: a path it cannot write is refused before the run
    (ValueError naming it), not found after it. Other ranks write nothing (their nodes may lack the folder)."""
    if path is None or rank != 0:
        return
    if not path:  # else the folder above the working directory would be checked, and nothing written
        raise ValueError("--json-out '': names no file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--json-out {path!r}: no folder {folder} to write it into")
    # A trailing slash names a folder (abspath drops it): open() refuses it even where none is there.
    if path.endswith(os.sep) or os.path.isdir(path) or not os.access(path if os.path.exists(path) else folder,
                                                                        os.W_OK):
        raise ValueError(f"--json-out {path!r}: not a file rank 0 can write")


def config_from_args(args: argparse.Namespace) -> TransferConfig:
    """The requests and the geometry the options describe (ValueError naming the values)."""
    requests = sized(args, "requests", _SIZES[0], _SMALL_SIZES[0])
    max_tokens = sized(args, "max_tokens", _SIZES[1], _SMALL_SIZES[1])
    if requests < 1 or max_tokens < 1:
        raise ValueError(f"--requests and --max-tokens must be >= 1, got {requests}, {max_tokens}")
    # Lengths spread over [max/4, max] with partial last blocks on both sides.
    tokens = tuple(max(1, max_tokens // 4 + (i * 37) % (max_tokens - max_tokens // 4 + 1)) for i in range(requests))
    kv_heads = args.kv_heads if args.kv_heads is not None else 1 if args.mla else _KV_HEADS
    geometry = KVGeometry(args.layers, kv_heads, args.head_size, args.dtype, args.mla)
    return TransferConfig(geometry, tokens, args.mode, args.deadline, args.kill_rank,
                          warmup=bool(getattr(args, "warmup", False)))


@dataclass(frozen=True, slots=True)
class TransferRun:
    """This rank's checked run: what :func:`check` returns and :func:`run` takes."""

    topology: PDTopology
    cfg: TransferConfig
    device: torch.device
    bind_host: str | None
    json_out: str | None


def check(args: argparse.Namespace, info: LaunchInfo) -> TransferRun:
    """The run the options describe on this rank, checked before anything connects (ValueError naming the values)."""
    topology = checked_topology(args, info)
    if topology is None:
        raise ValueError("--kind transfer needs a prefill/decode set: --prefill N --decode M [--prefill-tp ...]")
    cfg = config_from_args(args)
    for side, layout in (("prefill", topology.prefill), ("decode", topology.decode)):
        try:
            layout.check(cfg.geometry)
        except ValueError as exc:
            raise ValueError(f"--{side}-tp {layout.tp_size} --{side}-pp {layout.pp_size}: {exc}") from None
    check_kill(cfg, topology, info.world_size)
    check_json_out(args.json_out, info.rank)
    try:  # what every engine's EngineConfig loads, once the store is up: a bad value is a usage error here
        load_channel_auth()
    except ValueError as exc:
        raise ValueError(f"NCCLKV_SHARED_SECRET* / NCCLKV_CURVE_*: {exc}") from None
    return TransferRun(topology, cfg, resolve_device(args.device, info), resolve_bind_host(args.bind_host, info),
                       args.json_out)


def run(info: LaunchInfo, checked: TransferRun) -> None:
    topology, cfg = checked.topology, checked.cfg
    results = transfer_on_rank(info, topology, cfg, checked.device, checked.bind_host)
    if info.rank == 0:
        report(_summary_table(topology, cfg, results))
        if checked.json_out:
            with open(checked.json_out, "w", encoding="utf-8") as out:
                json.dump(summary_json(topology, cfg, results), out, indent=1)


def _summary_table(topology: PDTopology, cfg: TransferConfig, results: list[dict[str, object]]) -> str:
    """One line per decode rank: requests, bytes, seconds, GB/s; and the totals."""
    lines = [f"ncclkv transfer {topology} mode={cfg.mode} requests={len(cfg.tokens)} "
             f"tokens={sum(cfg.tokens)} geometry={cfg.geometry.num_layers}L x {cfg.geometry.num_kv_heads}H x "
             f"{cfg.geometry.head_size} {cfg.geometry.dtype}",
             f"{'rank':<36}{'requests':>9}{'tensors':>9}{'MiB':>10}{'s':>8}{'GB/s':>8}"]
    total_bytes, longest = 0.0, 0.0
    for row in results:
        if not str(row["place"]).startswith("decode"):
            continue
        nbytes, seconds = float(row["bytes"]), max(float(row["seconds"]), 1e-9)  # type: ignore[arg-type]
        total_bytes, longest = total_bytes + nbytes, max(longest, seconds)
        lines.append(f"{row['place']!s:<36}{int(row['requests']):>9}{int(row['tensors']):>9}"  # type: ignore[call-overload]
                     f"{nbytes / 2**20:>10.1f}{seconds:>8.3f}{nbytes / seconds / 1e9:>8.2f}")
    lines.append(f"{'all decode ranks':<36}{len(cfg.tokens):>9}{'':>9}{total_bytes / 2**20:>10.1f}"
                 f"{longest:>8.3f}{total_bytes / max(longest, 1e-9) / 1e9:>8.2f}")
    lines.append("every landed byte checked against the producer's KV: OK")
    return "\n".join(lines)


def summary_json(topology: PDTopology, cfg: TransferConfig, results: list[dict[str, object]]) -> dict[str, object]:
    """The summary as data: the set, the requests, every rank's numbers, and the decode side's totals."""
    decode = [row for row in results if str(row["place"]).startswith("decode")]
    nbytes = sum(int(row["bytes"]) for row in decode)  # type: ignore[call-overload]
    seconds = max((float(row["seconds"]) for row in decode), default=0.0)  # type: ignore[arg-type]
    g = cfg.geometry
    return {
        "topology": str(topology), "world_size": topology.world_size, "mode": cfg.mode,
        "num_prefill": topology.num_prefill, "num_decode": topology.num_decode,
        "requests": len(cfg.tokens), "tokens": sum(cfg.tokens),
        "geometry": {"num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads, "head_size": g.head_size,
                     "dtype": g.dtype, "use_mla": g.use_mla},
        "ranks": results, "decode_bytes": nbytes, "decode_seconds": seconds,
        "gbps": nbytes / max(seconds, 1e-9) / 1e9, "requests_per_s": len(cfg.tokens) / max(seconds, 1e-9),
    }
