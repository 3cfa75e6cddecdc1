"""The one place ncclkv reads its own environment variables.

Launcher variables (RANK, SLURM_PROCID, ...) are read by :mod:`ncclkv.launch`
from a mapping it is given; everything else configurable by environment is
listed here, parsed once into a typed value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["EnvSettings", "env_settings"]


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be > 0")
    return value


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be > 0")
    return value


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """Defaults that a deployment may override by environment.

    NCCLKV_DEADLINE_S        deadline of any single wait (default 10 s)
    NCCLKV_HEARTBEAT_S       heartbeat interval on the control channel (default 1 s)
    NCCLKV_BIND_HOST         address control and data sockets bind to (default 127.0.0.1)
    NCCLKV_STAGING_BYTES     receive staging capacity per engine (default 1 GiB)
    NCCLKV_MAX_FRAME_BYTES   largest control frame accepted (default 1 MiB)
    """

    deadline_s: float = 10.0
    heartbeat_s: float = 1.0
    bind_host: str = "127.0.0.1"
    staging_bytes: int = 1 << 30
    max_frame_bytes: int = 1 << 20


def env_settings(environ: Mapping[str, str] | None = None) -> EnvSettings:
    env = os.environ if environ is None else environ
    # An instance, not the class: on a slots dataclass the class attributes are member descriptors.
    default = EnvSettings()
    return EnvSettings(
        deadline_s=_float(env, "NCCLKV_DEADLINE_S", default.deadline_s),
        heartbeat_s=_float(env, "NCCLKV_HEARTBEAT_S", default.heartbeat_s),
        bind_host=env.get("NCCLKV_BIND_HOST") or default.bind_host,
        staging_bytes=_int(env, "NCCLKV_STAGING_BYTES", default.staging_bytes),
        max_frame_bytes=_int(env, "NCCLKV_MAX_FRAME_BYTES", default.max_frame_bytes),
    )
