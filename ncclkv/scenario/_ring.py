"""Scenario ``ring``: every rank streams tensors to its right neighbour over a data-plane link.

Rank ``r`` sends ``--count`` tensors of ``--nbytes`` to rank ``r+1`` and checks,
byte for byte and in order, the ones rank ``r-1`` sends it. Each tensor starts
with a header (magic, sender rank, seq) and continues with bytes drawn from a
generator seeded by (sender rank, seq), so a receiver can say what it got
instead. The data-plane addresses travel through the launcher's TCPStore.

``--kill-rank R --kill-at N``: rank R leaves with ``os._exit(9)`` once its
first N tensors are sent and received. Every survivor must then end with a
typed error (its neighbour links break, the others learn it at the final
rendezvous) within the deadline, which ``__main__`` turns into exit code 3.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .._timeout import check_timeout
from ..launch import LaunchInfo
from ..transport import DataPlane, Link
from ._common import checked_topology, resolve_bind_host, resolve_device, sized
from ._topology import PDTopology
from ._registry import ScenarioError, report
from ._rendezvous import StoreRendezvous

__all__ = ["HELP", "RingConfig", "RingRun", "add_arguments", "check", "check_payload", "ring_exchange", "ring_payload",
           "run"]

HELP = "tensors around a ring of data-plane links, checked byte-exact"
KILL_EXIT_CODE = 9
_MAGIC = 0x6E63636C6B76  # "ncclkv"
_HEADER_BYTES = 24  # three int64: magic, sender rank, seq
_COUNT, _NBYTES = 8, 1 << 20  # when not given
_SMALL_COUNT, _SMALL_NBYTES = 4, 64 * 1024  # when not given, with --small


@dataclass(frozen=True, slots=True)
class RingConfig:
    """One ring run: ``count`` tensors of ``nbytes`` per rank, each wait bounded by ``deadline_s``."""

    count: int = _COUNT
    nbytes: int = _NBYTES
    deadline_s: float = 10.0
    kill_rank: int | None = None
    kill_at: int = 0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if self.nbytes < _HEADER_BYTES or self.nbytes % 8:
            raise ValueError(f"nbytes must be a multiple of 8 and >= {_HEADER_BYTES}, got {self.nbytes}")
        check_timeout("deadline_s", self.deadline_s)
        if self.kill_rank is not None and not 0 <= self.kill_at < self.count:
            raise ValueError(f"kill_at must be in [0, count={self.count}), got {self.kill_at}")

    def check_world(self, world_size: int) -> None:
        if world_size < 2:
            raise ValueError(f"a ring needs at least 2 ranks, the launcher started {world_size}")
        if self.kill_rank is not None and not 0 <= self.kill_rank < world_size:
            raise ValueError(f"kill_rank={self.kill_rank} is outside world_size={world_size}")


def ring_payload(sender: int, seq: int, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` (uint8) that rank ``sender`` sends as tensor ``seq``."""
    gen = torch.Generator().manual_seed(sender * 1_000_003 + seq)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    payload[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor([_MAGIC, sender, seq], dtype=torch.int64))
    return payload


def check_payload(got: torch.Tensor, *, receiver: int, sender: int, seq: int) -> None:
    """Raise ScenarioError naming both ranks, the seq and the first differing byte unless ``got`` is exact."""
    got = got.cpu()
    expected = ring_payload(sender, seq, got.numel())
    if torch.equal(got, expected):
        return
    diff = (got != expected).nonzero()
    magic, head_rank, head_seq = (int(v) for v in got[:_HEADER_BYTES].view(torch.int64))
    header = f"rank {head_rank} seq {head_seq}" if magic == _MAGIC else "no valid header"
    raise ScenarioError(
        f"rank {receiver}: tensor seq {seq} from rank {sender} differs in {diff.numel()} of {got.numel()} bytes "
        f"(first at byte {int(diff[0])}); it carries {header}"
    )


def ring_exchange(
    plane: DataPlane,
    rank: int,
    addresses: list[str],
    config: RingConfig,
    device: torch.device,
    *,
    barrier: Callable[[], None],
    on_tensor: Callable[[int], None] | None = None,
) -> None:
    """Send ``config.count`` tensors right, receive and check as many from the left, then close both links.

    ``addresses[r]`` is rank r's data-plane address. ``barrier()`` runs once
    everything arrived and checked, before the links close: a closing link
    fails whatever its peer has not received yet. ``on_tensor(n)`` runs once
    the first n tensors were both sent and received, n = 0..count (the kill hook).
    """
    size = len(addresses)
    right, left = (rank + 1) % size, (rank - 1) % size
    # The sender hosts each link. Rank 0 opens right then left, every other rank
    # left then right: the opens complete one after another around the ring.
    def open_right() -> Link:
        return plane.open_link(f"ring.{rank}-{right}", 0, addresses[rank], device, config.deadline_s)

    def open_left() -> Link:
        return plane.open_link(f"ring.{left}-{rank}", 1, addresses[left], device, config.deadline_s)

    links: list[Link] = []
    try:
        for opener in (open_right, open_left) if rank == 0 else (open_left, open_right):
            links.append(opener())
        to_right, from_left = (links[0], links[1]) if rank == 0 else (links[1], links[0])
        sends: list[Future[None]] = []
        recvs: list[Future[torch.Tensor]] = []
        # The rank to be killed posts only what it completes: its neighbours then
        # have operations pending on the links when it dies.
        posted = config.kill_at if rank == config.kill_rank else config.count
        for seq in range(posted):  # post everything before waiting on anything
            sends.append(to_right.send(ring_payload(rank, seq, config.nbytes).to(device)))
            recvs.append(from_left.recv((config.nbytes,), torch.uint8))
        for seq in range(posted + 1):
            if on_tensor is not None:
                on_tensor(seq)
            if seq < posted:
                sends[seq].result(config.deadline_s + 1.0)  # the link fails it by its own deadline
                check_payload(recvs[seq].result(config.deadline_s + 1.0), receiver=rank, sender=left, seq=seq)
        barrier()
    finally:
        for link in links:
            link.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=None,
                        help=f"tensors each rank sends (default {_COUNT}; --small: {_SMALL_COUNT})")
    parser.add_argument("--nbytes", type=int, default=None,
                        help=f"bytes per tensor, a multiple of 8 (default {_NBYTES}; --small: {_SMALL_NBYTES})")
    parser.add_argument("--kill-rank", type=int, default=None, help="this rank os._exit(9)s after --kill-at tensors")
    parser.add_argument("--kill-at", type=int, default=None, help="tensors the killed rank completes first (default 0)")


@dataclass(frozen=True, slots=True)
class RingRun:
    """This rank's checked run: what :func:`check` returns and :func:`run` takes."""

    config: RingConfig
    topology: PDTopology | None
    device: torch.device
    bind_host: str | None


def check(args: argparse.Namespace, info: LaunchInfo) -> RingRun:
    """The run the options describe on this rank, checked before anything connects (ValueError naming the values)."""
    if args.kill_at is not None and args.kill_rank is None:  # nothing would be injected, and the run pass as if it had
        raise ValueError(f"--kill-at {args.kill_at} needs --kill-rank (which rank exits after it)")
    config = RingConfig(sized(args, "count", _COUNT, _SMALL_COUNT), sized(args, "nbytes", _NBYTES, _SMALL_NBYTES),
                        args.deadline, args.kill_rank, 0 if args.kill_at is None else args.kill_at)
    config.check_world(info.world_size)
    return RingRun(config, checked_topology(args, info), resolve_device(args.device, info),
                   resolve_bind_host(args.bind_host, info))


def run(info: LaunchInfo, checked: RingRun) -> None:
    config, topology, device = checked.config, checked.topology, checked.device
    place = f" as {topology.place(info.rank)}" if topology is not None else ""
    started = time.monotonic()
    rendezvous = StoreRendezvous(info, prefix="ncclkv/scenario/ring", deadline_s=config.deadline_s)
    with DataPlane(checked.bind_host) as plane:
        try:
            addresses = rendezvous.exchange(plane.address)
            kill = _kill_hook(info.rank, config)
            ring_exchange(plane, info.rank, addresses, config, device, barrier=rendezvous.finish, on_tensor=kill)
        except Exception as exc:  # every failure reaches the other ranks before this one raises
            rendezvous.report_failure(f"{type(exc).__name__}: {exc}")
            raise
    elapsed = time.monotonic() - started
    mib = config.count * config.nbytes / (1 << 20)
    report(
        f"ring rank {info.rank}/{info.world_size} ({info.launcher}{place}, {device}): "
        f"{config.count} tensors ({mib:.1f} MiB) sent to rank {(info.rank + 1) % info.world_size}, "
        f"{config.count} received byte-exact from rank {(info.rank - 1) % info.world_size} in {elapsed:.2f} s "
        f"(rendezvous {info.master_addr}:{info.master_port})"
    )


def _kill_hook(rank: int, config: RingConfig) -> Callable[[int], None] | None:
    if config.kill_rank != rank:
        return None

    def kill(done: int) -> None:
        if done >= config.kill_at:
            report(f"ring rank {rank}: exiting with {KILL_EXIT_CODE} after {done} tensors (--kill-rank)")
            sys.stderr.flush()
            os._exit(KILL_EXIT_CODE)

    return kill
