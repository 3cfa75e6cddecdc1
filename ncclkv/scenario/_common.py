"""Options every scenario kind shares, and how they resolve on one rank."""

from __future__ import annotations

import argparse
import socket

import torch

from .._env import env_settings
from .._timeout import check_timeout
from ..launch import LaunchInfo
from ..layout import ParallelLayout
from ._topology import PDTopology

__all__ = [
    "add_common_arguments", "checked_topology", "resolve_bind_host", "resolve_device", "sized",
    "topology_from_args",
]

def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return check_timeout(repr(text), value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--deadline", type=_seconds, default=None,  # NCCLKV_DEADLINE_S is read after parsing: --help never reads it
        help="seconds any single wait may take (default: NCCLKV_DEADLINE_S, else 10)",
    )
    parser.add_argument(
        "--small", action="store_true",
        help="a smoke-test size (CI, a laptop, a test cluster): each kind shrinks those of its sizes not given",
    )
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"),
        help="cpu, cuda, or auto: cuda when every local rank gets its own GPU (one visible per local rank, "
        "or Slurm's --gpus-per-task), else cpu",
    )
    parser.add_argument(
        "--bind-host", default=None,
        help="address the data plane binds to and publishes; 'auto': this host's address on the route to "
        "MASTER_ADDR (default: NCCLKV_BIND_HOST, 'auto' included, else 127.0.0.1)",
    )
    group = parser.add_argument_group("prefill/decode set (optional; the launch scripts pass it)")
    group.add_argument("--prefill", type=_positive_int, default=None, help="number of prefill instances")
    group.add_argument("--prefill-tp", type=_positive_int, default=1)
    group.add_argument("--prefill-pp", type=_positive_int, default=1)
    group.add_argument("--decode", type=_positive_int, default=None, help="number of decode instances")
    group.add_argument("--decode-tp", type=_positive_int, default=1)
    group.add_argument("--decode-pp", type=_positive_int, default=1)


def sized(args: argparse.Namespace, option: str, default: int, small: int) -> int:
    """The size option ``option`` (an attribute of ``args``, None when not given): a value given wins; else
    ``small`` with --small, else ``default``."""
    value: int | None = getattr(args, option)
    if value is not None:
        return value
    return small if args.small else default


def topology_from_args(args: argparse.Namespace) -> PDTopology | None:
    """The P/D set the options describe, or None when neither --prefill nor --decode is given."""
    if args.prefill is None and args.decode is None:
        return None
    if args.prefill is None or args.decode is None:
        raise ValueError(f"give both --prefill and --decode (got --prefill={args.prefill}, --decode={args.decode})")
    return PDTopology(
        args.prefill, ParallelLayout(args.prefill_tp, args.prefill_pp),
        args.decode, ParallelLayout(args.decode_tp, args.decode_pp),
    )


def checked_topology(args: argparse.Namespace, info: LaunchInfo) -> PDTopology | None:
    """:func:`topology_from_args`, checked against the ranks the launcher started (ValueError naming the values).

    ``__main__`` runs it before any scenario (a ValueError: a usage error, exit 2); a scenario's ``check``
    calls it again for the topology.
    """
    topology = topology_from_args(args)
    if topology is not None:
        topology.check_world(info.world_size, info.launcher)
    return topology


def resolve_device(spec: str, info: LaunchInfo) -> torch.device:
    """``cpu``, ``cuda`` (the local rank's GPU) or ``auto``."""
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_size = info.local_world_size or info.world_size
    if spec == "auto":
        # Two ranks of one NCCL link cannot share a GPU: CUDA only when each local rank has its
        # own, either seen here (one per local rank) or bound to each task by Slurm
        # (--gpus-per-task, where every task sees just its own); else gloo on the CPU.
        own_gpu = num_gpus >= local_size or (num_gpus >= 1 and info.gpus_per_task is not None)
        spec = "cuda" if own_gpu else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda":
        if num_gpus == 0:
            raise ValueError(f"--device cuda on rank {info.rank}, but torch sees no GPU")
        return torch.device("cuda", info.local_rank % num_gpus)
    raise ValueError(f"--device must be cpu, cuda or auto, got {spec!r}")


def _check_bindable(host: str, name: str) -> None:
    """ValueError naming ``name`` unless a TCP socket can bind to ``host`` here."""
    try:
        family, kind, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as sock:
            sock.bind(sockaddr)
    except OSError as err:
        raise ValueError(f"{name} {host!r} is not an address of this host to bind to: {err}") from None


def resolve_bind_host(spec: str | None, info: LaunchInfo) -> str | None:
    """None keeps the data plane's default; ``auto`` finds the local address that routes to the master. A host
    given (here or by NCCLKV_BIND_HOST) must be one of this host's: else a ValueError now, not the data plane's
    OSError once the ranks are running."""
    if spec != "auto":
        if spec is not None:
            _check_bindable(spec, "--bind-host")
        else:
            _check_bindable(env_settings().bind_host, "NCCLKV_BIND_HOST")
        return spec
    family, _, _, _, sockaddr = socket.getaddrinfo(info.master_addr, info.master_port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)  # UDP connect picks a route and sends nothing
        host = str(sock.getsockname()[0])
    spans_nodes = info.local_world_size is not None and info.local_world_size < info.world_size
    if spans_nodes and (host.startswith("127.") or host == "::1"):
        raise ValueError(
            f"rank {info.rank}: --bind-host auto found loopback {host} on the way to MASTER_ADDR="
            f"{info.master_addr}, but the job spans several nodes: set MASTER_ADDR to a routable address"
        )
    return host
