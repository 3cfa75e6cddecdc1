"""The connector's typed configuration: vLLM's ``kv_connector_extra_config`` parsed at the boundary.

No vLLM import here, so the parsing is testable (and usable by tools) without vLLM.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal, Union, get_args, get_origin, get_type_hints

from .._timeout import check_timeout
from ..engine import DEFAULT_LAST_PIECE_BYTES, DEFAULT_PULL_BATCH_BYTES, Role
from ..paged import CacheLayout

__all__ = ["KVRole", "NcclKVConfig", "engine_role"]

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
_ENGINE_ROLES: dict[str, Role] = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}


def engine_role(kv_role: str | None) -> Role:
    """vLLM's ``kv_role`` as the transfer engine's role; ValueError naming the value otherwise."""
    role = _ENGINE_ROLES.get(kv_role or "")
    if role is None:
        raise ValueError(f"kv_role must be one of {sorted(_ENGINE_ROLES)}, got {kv_role!r}")
    return role


@dataclass(frozen=True, slots=True)
class NcclKVConfig:
    """``kv_connector_extra_config`` of :class:`ncclkv.connector.NcclKVConnector`.

    deadline_s, heartbeat_s, staging_bytes, bind_host
        Transfer-engine settings; unset ones come from ``NCCLKV_*`` (ncclkv._env).
    hold_s
        How long a producer keeps a request's blocks for a consumer that has
        not pulled them, from the step that completed its prompt; then they
        are freed and the pull fails.
    free_wait_s
        Producer: when vLLM cannot allocate blocks for a running request it
        asks whether held blocks will be freed soon (``has_pending_block_frees``)
        before it preempts one: the answer is yes while a request that
        finished here within this many seconds still holds its blocks for a
        transfer (a pull, a push, a release). Its running requests then wait
        (step after step, this long at most) instead of being preempted and
        recomputed; past it (a decode engine slow to pull) vLLM preempts as
        without the connector. 0: never wait. Capped by ``hold_s`` in effect.
        1 s by default: the wait stalls every running request behind the one
        that did not fit, and a pull of even a long prompt's KV takes a small
        part of that; a hold older than this is a decode engine busy or gone.
    piece_bytes
        Producer: send each layer's slice of a route in token pieces of at most
        this many bytes, each announced alone, so the gather, the wire and the
        consumer's scatter of one layer overlap (the last layer's latency after
        prefill). 0 (default): one tensor per layer and route. Consumers accept
        either.
    last_piece_bytes
        Producer, push: the same for a route's last layer only, the one whose
        gather, wire and scatter are left after the forward pass (earlier
        layers hide behind compute and go whole). 0 (default) sends it whole:
        on 2 CPU cores it did not shorten that tail (``ncclkv.engine``'s
        ``DEFAULT_LAST_PIECE_BYTES`` says why). ``piece_bytes``, when smaller,
        wins.
    pull_batch_bytes
        Producer, pull: send a route's consecutive layers whose slices are
        small in one tensor of at most this many bytes (4 MiB by default), so
        short prompts and TP-split kv heads do not pay a tensor's fixed costs
        (announcement, frame header, thread hand-offs) per layer. 0: a tensor
        per layer. Slices cut into pieces (``piece_bytes``) go alone, and
        ``piece_bytes``, when set, bounds a run too.
    async_load
        Consumer: True (default) loads between scheduler steps (the request
        waits in WAITING_FOR_REMOTE_KVS, nothing blocks the forward pass).
        False loads inside the forward pass of the step that computes the
        rest of the prompt, layer by layer (``wait_for_layer_load`` waits for
        that layer only); the last prompt token is always computed locally.
    idle_wait_ms
        On a step where vLLM scheduled no tokens (it steps again at once, only
        to poll the connector) while transfers are in flight, a worker waits up
        to this long for a load to land, or sleeps this long for sends, instead
        of returning at once. The engine's step loop otherwise holds the GIL
        that ncclkv's receive and send threads need, and CPython hands it over
        only every switch interval (5 ms). 0 turns it off. It delays a new
        request arriving during such a step by at most this much.
    cache_layout
        Name of a :class:`ncclkv.paged.CacheLayout` (``"packed"``, ``"cpu"``,
        ...) when the shape of vLLM's KV cache is ambiguous; default: detected.
    ref_path
        When set, the scheduler writes this engine's ``EngineRef`` (JSON, every
        rank's control address) to this file once all workers reported. A
        client that wants push mode passes it as ``remote_decode``.
    corrupt_for_test
        TEST-ONLY. A consumer flips the sign bit of every value it loaded before
        vLLM reads it, so a test can prove that the transferred KV is used.
        Never set it in a deployment.
    """

    deadline_s: float | None = None
    heartbeat_s: float | None = None
    staging_bytes: int | None = None
    bind_host: str | None = None
    hold_s: float = 120.0
    free_wait_s: float = 1.0
    piece_bytes: int = 0
    last_piece_bytes: int = DEFAULT_LAST_PIECE_BYTES
    pull_batch_bytes: int = DEFAULT_PULL_BATCH_BYTES
    async_load: bool = True
    idle_wait_ms: float = 2.0
    cache_layout: str | None = None
    ref_path: str | None = None
    corrupt_for_test: bool = False

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        for name in ("deadline_s", "heartbeat_s", "hold_s"):
            value = getattr(self, name)
            if value is not None:  # its type was checked above: only ValueError can come
                check_timeout(f"kv_connector_extra_config[{name!r}]", value)
        if self.free_wait_s != 0:
            check_timeout("kv_connector_extra_config['free_wait_s'] (0: never wait)", self.free_wait_s)
        if self.heartbeat_s is not None and self.deadline_s is not None and self.heartbeat_s >= self.deadline_s:
            raise ValueError(f"kv_connector_extra_config['heartbeat_s']={self.heartbeat_s:g} must be below "
                             f"'deadline_s'={self.deadline_s:g}: a peer silent for deadline_s is lost")
        if not 0 <= self.idle_wait_ms <= 1000:
            raise ValueError(f"kv_connector_extra_config['idle_wait_ms'] must be in [0, 1000], got {self.idle_wait_ms!r}")
        for name in ("piece_bytes", "last_piece_bytes", "pull_batch_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be >= 0, got {getattr(self, name)!r}")
        if self.staging_bytes is not None and self.staging_bytes < 1:
            raise ValueError(f"kv_connector_extra_config['staging_bytes'] must be >= 1, got {self.staging_bytes!r}")
        if self.cache_layout is not None:
            self.layout()  # validates the name

    @classmethod
    def from_extra(cls, extra: Mapping[str, object] | None) -> NcclKVConfig:
        """Parse the extra config; unknown keys raise ValueError naming them and the known ones."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys for NcclKVConnector: {unknown}; "
                             f"known keys: {sorted(known)}")
        return cls(**extra)  # type: ignore[arg-type]

    def layout(self) -> CacheLayout | None:
        if self.cache_layout is None:
            return None
        try:
            return CacheLayout(self.cache_layout)
        except ValueError:
            names = [layout.value for layout in CacheLayout]
            raise ValueError(f"kv_connector_extra_config['cache_layout']={self.cache_layout!r} is not one of "
                             f"{names}") from None


def _check_type(name: str, value: object, hint: object) -> None:
    """Exact types: a bool is not an int, an int is accepted for a float."""
    allowed = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return
        if kind is bool and isinstance(value, bool):
            return
        if kind in (int, float) and isinstance(value, int) and not isinstance(value, bool):
            return
        if kind is float and isinstance(value, float):
            return
        if kind is str and isinstance(value, str):
            return
    names = " or ".join("None" if k is type(None) else getattr(k, "__name__", str(k)) for k in allowed)
    raise ValueError(f"kv_connector_extra_config[{name!r}] must be {names}, got {type(value).__name__} {value!r}")
