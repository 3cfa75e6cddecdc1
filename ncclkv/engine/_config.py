"""Typed configuration of a transfer engine and the reference to a remote engine."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Literal

from .._affinity import cpus_from_setting
from .._env import WILDCARD_HOSTS, env_settings
from .._timeout import check_timeout
from ..auth import ChannelAuth, load_channel_auth
from ..channel import check_address
from ..layout import KVGeometry, ParallelLayout
from ..errors import ProtocolError
from ..protocol import MAX_ID_CHARS, Envelope, Handshake, encode

__all__ = [
    "DEFAULT_LAST_PIECE_BYTES", "DEFAULT_PULL_BATCH_BYTES", "EngineConfig", "EngineRef", "Role", "is_int",
    "holds_differ", "parse_peer_id", "peer_id", "split_peer_id",
]

# A push may send a route's last layer in token pieces (last_piece_bytes): only that layer's latency is left after
# the forward, and pieces could overlap its gather, wire and scatter while earlier layers, hidden behind compute,
# go whole. Off by default: on 2 cores it left 1.47-1.68 layers exposed at c >= x against 1.29-1.44 whole (bench
# overlap: its pieces' wire buffers, idle for a whole request, come back cold, and gather and scatter into them
# ran 1.4x slower). bench overlap keeps measuring it for machines whose copies have cores of their own.
DEFAULT_LAST_PIECE_BYTES = 0
# A pull sends the consecutive layers of a route whose slices are small together, as one tensor of at most this
# many bytes: every tensor costs an announcement, a frame header and a few thread hand-offs on each side (about as
# much as moving 0.5-1 MiB on two CPU cores, bench transfer's link/raw), which small slices (short prompts, kv
# heads split by TP) would otherwise pay per layer. A pull waits for every layer anyway (the consumer loads
# between steps), or for its layers in order (loading in the forward), and these tensors are short on the wire.
DEFAULT_PULL_BATCH_BYTES = 4 << 20

Role = Literal["producer", "consumer", "both"]
_ENGINE_ID = re.compile(r"[A-Za-z0-9._:@+-]{1,128}")


def _check_engine_id(engine_id: object) -> None:
    if not isinstance(engine_id, str) or not _ENGINE_ID.fullmatch(engine_id):
        raise ValueError(f"engine_id must be 1-128 chars of [A-Za-z0-9._:@+-], got {engine_id!r}")


def is_int(value: object) -> bool:
    """An int, not a bool (``True`` is an int in Python, never a count or an id here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def peer_id(engine_id: str, rank: int) -> str:
    """The control-channel name of one rank of one engine."""
    return f"{engine_id}.r{rank}"


_PEER_ID = re.compile(r"(.+)\.r([0-9]+)")


def split_peer_id(name: str) -> tuple[str, int]:
    """``(engine_id, rank)`` of a name made by :func:`peer_id` (engine ids may hold dots, never ``.r<digits>``
    at their end: the last one is the rank's); ``ValueError`` naming it for any other name."""
    parsed = parse_peer_id(name)
    if parsed is None:
        raise ValueError(f"peer id {name!r} is not an engine rank's (<engine id>.r<rank>)")
    return parsed


def parse_peer_id(name: str) -> tuple[str, int] | None:
    """``(engine_id, rank)`` of an engine rank's peer id, None for any other name (a raw channel client may
    reach a channel under any id)."""
    match = _PEER_ID.fullmatch(name)
    return None if match is None else (match.group(1), int(match.group(2)))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One rank of one engine. Unset deadlines and sizes come from :func:`env_settings`.

    ``hold_s`` is how long a producer keeps a finished request's blocks for
    consumers that have not pulled them yet; after it they are released and
    the request is reported as expired. ``auth`` authenticates the control
    channel and keys the data-plane link ids (:class:`~ncclkv.auth.ChannelAuth`).
    """

    engine_id: str
    rank: int
    layout: ParallelLayout
    geometry: KVGeometry
    role: Role = "both"
    device: str = "cpu"
    bind_host: str | None = None
    deadline_s: float | None = None
    heartbeat_s: float | None = None
    staging_bytes: int | None = None
    hold_s: float = 120.0
    piece_bytes: int = 0  # producer: send each (layer, route) slice in token pieces of at most this; 0: whole
    # push: a route's last layer in pieces of at most this (0: whole), see DEFAULT_LAST_PIECE_BYTES
    last_piece_bytes: int = DEFAULT_LAST_PIECE_BYTES
    # pull: a route's consecutive layers in one tensor of at most this (0: a tensor per layer), see
    # DEFAULT_PULL_BATCH_BYTES; slices cut into pieces (piece_bytes) go alone, and piece_bytes bounds a run too
    pull_batch_bytes: int = DEFAULT_PULL_BATCH_BYTES
    wire_cache_bytes: int | None = None  # free CPU wire buffers kept for reuse (0: none); None: environment
    # The CPUs the engine's threads run on (ncclkv._affinity); None: NCCLKV_CPUS, and unset there, each thread
    # keeps the mask of the thread that started it.
    cpus: frozenset[int] | None = None
    # None: from the environment (NCCLKV_SHARED_SECRET*, NCCLKV_CURVE_*; docs/SECURITY.md).
    auth: ChannelAuth | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_engine_id(self.engine_id)
        if self.role not in ("producer", "consumer", "both"):
            raise ValueError(f"role must be producer, consumer or both, got {self.role!r}")
        if not is_int(self.rank) or not 0 <= self.rank < self.layout.world_size:
            raise ValueError(f"rank={self.rank!r} outside the layout's world_size={self.layout.world_size}")
        self.layout.check(self.geometry)
        _check_handshake(self)
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name in ("deadline_s", "heartbeat_s", "hold_s"):
            value = getattr(self, name)
            if value is not None:  # None: from the environment below, which env_settings checked by the same rule
                check_timeout(name, value)
        if self.staging_bytes is not None and not (is_int(self.staging_bytes) and self.staging_bytes >= 1):
            raise ValueError(f"staging_bytes must be an int >= 1, got {self.staging_bytes!r}")
        for name in ("piece_bytes", "last_piece_bytes", "pull_batch_bytes"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 0):
                off = "a tensor per layer" if name == "pull_batch_bytes" else "whole slices"
                raise ValueError(f"{name} must be an int >= 0 (0: {off}), got {value!r}")
        cache = self.wire_cache_bytes
        if cache is not None and not (is_int(cache) and cache >= 0):
            raise ValueError(f"wire_cache_bytes must be an int >= 0 (0: keep none), got {cache!r}")
        settings = env_settings()
        if self.cpus is None:
            object.__setattr__(self, "cpus", cpus_from_setting(settings.cpus, os.environ))
        else:
            cpus = self.cpus
            if (not isinstance(cpus, (set, frozenset)) or not cpus
                    or not all(is_int(c) and c >= 0 for c in cpus)):
                raise ValueError(f"cpus must be a non-empty set of CPU numbers >= 0, got {cpus!r}")
            object.__setattr__(self, "cpus", frozenset(cpus))
        if self.deadline_s is None:
            object.__setattr__(self, "deadline_s", settings.deadline_s)
        if self.heartbeat_s is None:
            object.__setattr__(self, "heartbeat_s", min(settings.heartbeat_s, self.deadline_s / 4))
        if self.deadline_s < _MIN_DEADLINE_S:  # torch's store counts whole milliseconds: 0 would be no deadline
            raise ValueError(f"deadline_s={self.deadline_s:g} must be at least {_MIN_DEADLINE_S:g} s")
        if self.heartbeat_s >= self.deadline_s:  # else a peer would be lost between two of its heartbeats
            raise ValueError(f"heartbeat_s={self.heartbeat_s:g} must be below deadline_s={self.deadline_s:g}")
        if self.staging_bytes is None:
            object.__setattr__(self, "staging_bytes", settings.staging_bytes)
        if self.wire_cache_bytes is None:
            object.__setattr__(self, "wire_cache_bytes", settings.wire_cache_bytes)
        if self.bind_host is None:
            object.__setattr__(self, "bind_host", settings.bind_host)
        if not isinstance(self.bind_host, str) or self.bind_host.strip().strip("[]") in WILDCARD_HOSTS:
            # An engine advertises the address it binds (handshakes, vLLM's kv_transfer_params): a peer on
            # another host told "0.0.0.0" connects to itself, and waits deadline_s for every request.
            raise ValueError(f"bind_host={self.bind_host!r} (EngineConfig, kv_connector_extra_config or "
                             f"NCCLKV_BIND_HOST) is not an address peers can reach: an engine advertises the "
                             f"address it binds; give this host's address on the network the peers share")
        if self.auth is None:
            object.__setattr__(self, "auth", load_channel_auth(settings))
        elif not isinstance(self.auth, ChannelAuth):
            raise TypeError(f"auth must be a ChannelAuth or None, got {type(self.auth).__name__}")

    @property
    def peer_id(self) -> str:
        return peer_id(self.engine_id, self.rank)


@dataclass(frozen=True, slots=True)
class EngineRef:
    """How to reach every rank of an engine; travels in vLLM's ``kv_transfer_params``.

    ``incarnations``: each rank's channel incarnation when the reference was made (the life of its peer id that
    holds what the reference is about), or empty when not known (a reference made by hand, or by a build before
    they were carried; 0 for one rank: not known). A consumer refuses at once a reference that names a life of
    a peer id it has since seen replaced (``PeerLinks.ensure``) instead of resetting the live one for it.
    """

    engine_id: str
    layout: ParallelLayout
    control_addrs: tuple[str, ...]
    incarnations: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_engine_id(self.engine_id)
        if not isinstance(self.layout, ParallelLayout):
            raise ValueError(f"engine {self.engine_id!r}: layout must be a ParallelLayout, got {self.layout!r}")
        if isinstance(self.control_addrs, (str, bytes)) or not isinstance(self.control_addrs, (list, tuple)):
            raise ValueError(f"engine {self.engine_id!r}: control_addrs must be a list of addresses, got "
                             f"{self.control_addrs!r:.200}")
        object.__setattr__(self, "control_addrs", tuple(self.control_addrs))
        bad = [a for a in self.control_addrs if not isinstance(a, str) or not 1 <= len(a) <= MAX_ID_CHARS]
        if bad:
            raise ValueError(f"engine {self.engine_id!r}: control addresses must be strs like 'tcp://host:port', "
                             f"got {bad[:4]!r:.200}")
        for rank, address in enumerate(self.control_addrs):  # here, not at the first pull: params are checked whole
            try:
                check_address(address)
            except ValueError as err:
                raise ValueError(f"engine {self.engine_id!r}: control address of rank {rank}: {err}") from None
        object.__setattr__(self, "incarnations", tuple(self.incarnations))
        if len(self.control_addrs) != self.layout.world_size:
            raise ValueError(
                f"engine {self.engine_id!r}: {len(self.control_addrs)} control addresses for "
                f"world_size={self.layout.world_size} (tp={self.layout.tp_size}, pp={self.layout.pp_size})"
            )
        if self.incarnations and len(self.incarnations) != self.layout.world_size:
            raise ValueError(f"engine {self.engine_id!r}: {len(self.incarnations)} incarnations for "
                             f"world_size={self.layout.world_size}")
        if not all(is_int(i) and 0 <= i <= _MAX_INCARNATION for i in self.incarnations):
            raise ValueError(f"engine {self.engine_id!r}: incarnations must be ints in [0, 2**63), "
                             f"got {list(self.incarnations)!r}")

    def peer_id(self, rank: int) -> str:
        return peer_id(self.engine_id, rank)

    def incarnation(self, rank: int) -> int:
        """Rank ``rank``'s channel incarnation when this reference was made; 0 when not known."""
        return self.incarnations[rank] if self.incarnations else 0

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = {
            "engine_id": self.engine_id,
            "tp_size": self.layout.tp_size,
            "pp_size": self.layout.pp_size,
            "layer_partition": list(self.layout.layer_partition) if self.layout.layer_partition else None,
            "control_addrs": list(self.control_addrs),
        }
        if any(self.incarnations):
            # Hex strings: 63-bit ints pass through JSON clients that read numbers as doubles (2**53) rounded.
            data["incarnations"] = [f"{i:#x}" for i in self.incarnations]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> EngineRef:
        """The reference :meth:`to_dict` made; ``incarnations`` may be absent (a build that did not carry them, or
        none known): the ranks' lives are then not known. Anything else is a ValueError naming it (it comes from
        other engines through clients)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"engine reference must be a dict, got {type(data).__name__}: {data!r:.200}")
        try:
            partition = data.get("layer_partition")
            sizes = {name: data[name] for name in ("tp_size", "pp_size")}
            # From other engines' kv_transfer_params, through clients: ints only (int(1e999) raises OverflowError).
            for name, value in sizes.items():
                if not is_int(value):
                    raise ValueError(f"engine reference {name} must be an int, got {value!r}")
            if partition and (not isinstance(partition, (list, tuple)) or not all(map(is_int, partition))):
                raise ValueError(f"engine reference layer_partition must be a list of ints, got {partition!r}")
            layout = ParallelLayout(sizes["tp_size"], sizes["pp_size"], tuple(partition) if partition else None)  # type: ignore[arg-type]
            return cls(data["engine_id"], layout, data["control_addrs"],  # type: ignore[arg-type]
                       _incarnations(data.get("incarnations")))
        except KeyError as err:
            raise ValueError(f"engine reference is missing {err.args[0]!r}: {data!r}") from None


_MIN_DEADLINE_S = 0.001
_MAX_INCARNATION = 2**63 - 1  # a channel's incarnation fits 63 bits (ncclkv.channel.new_incarnation)
_HEX_63 = re.compile(r"0x[0-9a-f]{1,16}")  # a 63-bit number as references and params write it (JSON's doubles
# would round it as a number)


def holds_differ(one: int, other: int) -> bool:
    """Whether hold numbers ``one`` and ``other`` name different holds of a request id: both named (0: not
    named, which matches any)."""
    return bool(one and other and one != other)


def hex_int(value: object, refused: str) -> int:
    """A number as :meth:`EngineRef.to_dict` and the connector's params write it (``"0x..."``; an int taken too);
    ValueError ``"<refused>, got <value>"`` for anything else. Bounds are the caller's."""
    if isinstance(value, str) and _HEX_63.fullmatch(value):
        return int(value, 16)
    if is_int(value):
        return value  # type: ignore[return-value]
    raise ValueError(f"{refused}, got {value!r}")


def _incarnations(value: object) -> tuple[int, ...]:
    """An engine reference's ``incarnations`` as :meth:`EngineRef.to_dict` writes them (``"0x..."`` strings; ints
    taken too); absent or null: none known. ValueError naming anything else."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"engine reference incarnations must be a list, got {value!r}")
    return tuple(hex_int(item, "engine reference incarnations must be '0x...' hex strings") for item in value)


def _check_handshake(cfg: EngineConfig) -> None:
    """ValueError if every peer would refuse this engine's handshake (a model dimension past the protocol's bounds,
    e.g. num_layers > MAX_MODEL_DIM): at the call, not at each handshake once the engine runs. The addresses are
    stand-ins: the engine's own are checked where it binds them."""
    hello = Handshake.create(cfg.engine_id, cfg.role, cfg.rank, cfg.layout, cfg.geometry, "tcp://127.0.0.1:1",
                             "127.0.0.1:1")
    try:
        encode(Envelope(cfg.peer_id, 0, None, hello))
    except ProtocolError as exc:
        raise ValueError(f"engine {cfg.engine_id!r}: every peer would refuse its handshake: {exc}") from None
