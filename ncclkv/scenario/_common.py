"""Options every scenario kind shares, and how they resolve on one rank."""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import struct
from collections.abc import Mapping

import torch

from .._env import GLOO_IFNAME_VAR, env_settings, is_auto_host
from .._timeout import check_timeout
from ..launch import LOCAL_SIZE_VARS, LaunchInfo, slurm_node_count
from ..layout import ParallelLayout
from ._topology import PDTopology

__all__ = [
    "add_common_arguments", "checked_topology", "interface_ipv4", "resolve_bind_host", "resolve_device", "sized",
    "topology_from_args",
]

_SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address

def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return check_timeout(repr(text), value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bind_host(text: str) -> str:
    """``--bind-host``'s value: ``auto`` in any case and spacing, as NCCLKV_BIND_HOST takes it (the launch scripts
    pass that variable on as this option); else the host as given."""
    return "auto" if is_auto_host(text) else text


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
        "--bind-host", default=None, type=_bind_host,
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
    except (OSError, UnicodeError) as err:  # UnicodeError: a name IDNA cannot encode ('a..b', a label over 63)
        raise ValueError(f"{name} {host!r} is not an address of this host to bind to: {err}") from None


def interface_ipv4(name: str) -> str:
    """The IPv4 address of network interface ``name`` on this host (Linux); ValueError naming the interface when
    there is none of that name, or it has no IPv4 address."""
    names = sorted(ifname for _, ifname in socket.if_nameindex())
    if name not in names:
        raise ValueError(f"{GLOO_IFNAME_VAR}={name!r}: this host has no network interface {name!r} "
                         f"(it has {', '.join(names) or 'none'})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:  # SIOCGIFADDR: the interface's (primary) IPv4 address
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as err:
            raise ValueError(f"{GLOO_IFNAME_VAR}={name!r}: interface {name!r} has no IPv4 address "
                             f"({err.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def _route_host(info: LaunchInfo) -> str:
    """This host's address on the route to MASTER_ADDR; ValueError naming MASTER_ADDR when it does not resolve or
    no route leads there."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(info.master_addr, info.master_port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)  # UDP connect picks a route and sends nothing
            return str(sock.getsockname()[0])
    except (OSError, UnicodeError) as exc:  # UnicodeError: a name idna cannot encode (an empty label, one past 63)
        raise ValueError(
            f"rank {info.rank}: --bind-host auto: no route from this host to MASTER_ADDR={info.master_addr!r} "
            f"({exc}): set MASTER_ADDR to the address of rank 0's node, {GLOO_IFNAME_VAR} to the interface between "
            f"nodes, or give --bind-host (NCCLKV_BIND_HOST) an address") from None


def _auto_host(info: LaunchInfo, env: Mapping[str, str]) -> tuple[str, str]:
    """(address, where it came from) for ``--bind-host auto``: GLOO_SOCKET_IFNAME's interface when it names one,
    else the route to MASTER_ADDR (which must then leave by one of the interfaces it names)."""
    text = (env.get(GLOO_IFNAME_VAR) or "").strip()
    names = [name.strip() for name in text.split(",") if name.strip()]
    if len(names) == 1:
        return interface_ipv4(names[0]), f"{GLOO_IFNAME_VAR}={names[0]}"
    host = _route_host(info)
    where = f"the route to MASTER_ADDR={info.master_addr}"
    if names:
        addresses = {}
        for name in names:
            try:
                addresses[name] = interface_ipv4(name)
            except ValueError:
                addresses[name] = None
        if host not in addresses.values():
            found = ", ".join(f"{name}: {addr or 'no IPv4 address'}" for name, addr in addresses.items())
            raise ValueError(
                f"rank {info.rank}: --bind-host auto: {GLOO_IFNAME_VAR}={text!r} names several interfaces ({found}) "
                f"and {where} leaves by {host}, none of theirs: name one interface in {GLOO_IFNAME_VAR}, or give "
                f"--bind-host (NCCLKV_BIND_HOST) an address")
    return host, where


def _loopback_refusal(info: LaunchInfo, host: str, where: str, env: Mapping[str, str]) -> str | None:
    """Why binding loopback ``host`` would cut this rank off from ranks on other nodes; None when every rank is
    known to run on this node."""
    if info.world_size == 1 or info.local_world_size == info.world_size:
        return None
    local_var = LOCAL_SIZE_VARS.get(info.launcher, "LOCAL_WORLD_SIZE")
    nodes = slurm_node_count(env)
    if info.local_world_size is None and nodes is not None and nodes[1] == 1:
        return None  # a one-node Slurm step or job: every rank is here
    if info.local_world_size is not None:
        spread = f"the job spans several nodes ({local_var}: {info.local_world_size} of {info.world_size} ranks here)"
    elif nodes is not None:
        spread = f"the job spans several nodes ({nodes[0]}={nodes[1]})"
    else:
        spread = (f"nothing says that all {info.world_size} ranks run on this node ({local_var} is not set; on one "
                  f"node set {local_var}={info.world_size})")
    if info.launcher == "torchrun":
        fix = ("torchrun sets MASTER_ADDR itself, to the rank-0 agent's --local-addr or else its host name "
               "(getfqdn(), which resolves to loopback on many hosts): start torchrun with --local-addr <the node's "
               "routable address> on every node (launch/torchrun_pd.sh: LOCAL_ADDR)")
    else:
        fix = "set MASTER_ADDR to a routable address"
    return (f"rank {info.rank}: --bind-host auto found loopback {host} ({where}), but {spread}: {fix}, or "
            f"{GLOO_IFNAME_VAR} to the interface between nodes, or give --bind-host (NCCLKV_BIND_HOST) an address")


def resolve_bind_host(spec: str | None, info: LaunchInfo, environ: Mapping[str, str] | None = None) -> str | None:
    """None keeps the data plane's default; ``auto`` takes the address of the interface GLOO_SOCKET_IFNAME names,
    else the local address that routes to the master. A host given (here or by NCCLKV_BIND_HOST) must be one of
    this host's: else a ValueError now, not the data plane's OSError once the ranks are running. ``auto`` never
    gives a loopback address unless every rank is known to run on this node (``environ``: os.environ by default,
    for GLOO_SOCKET_IFNAME and Slurm's node counts)."""
    if spec != "auto":
        if spec is not None:
            _check_bindable(spec, "--bind-host")
        else:
            _check_bindable(env_settings().bind_host, "NCCLKV_BIND_HOST")
        return spec
    env = os.environ if environ is None else environ
    host, where = _auto_host(info, env)
    if host.startswith("127.") or host == "::1":
        refusal = _loopback_refusal(info, host, where, env)
        if refusal is not None:
            raise ValueError(refusal)
    return host
