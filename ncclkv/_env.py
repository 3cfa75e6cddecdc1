"""The one place ncclkv reads its own environment variables.

Launcher variables (RANK, SLURM_PROCID, ...) are read by :mod:`ncclkv.launch`
from a mapping it is given; everything else configurable by environment is
listed here and parsed into a typed value by :func:`env_settings`, on every call (not cached: a value set
after import, as tests and the scenario entry point do, is seen by the next reader).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from ._affinity import parse_cpu_list
from ._timeout import check_timeout

__all__ = ["BIND_HOST_VAR", "GLOO_IFNAME_VAR", "MAX_COPY_THREADS", "PAGED_KERNELS", "PP_PARTITION_VAR",
           "WILDCARD_HOSTS", "EnvSettings", "env_settings", "is_auto_host", "take_bind_host_auto"]


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """A timeout or interval, by the rule of :func:`ncclkv._timeout.check_timeout`."""
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
    return check_timeout(f"{name}={text!r}", value)  # the text as set, then the value it parsed to


def _int(environ: Mapping[str, str], name: str, default: int, least: int = 1, most: int | None = None) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < least:
        raise ValueError(f"{name}={text!r} must be >= {least}")
    if most is not None and value > most:
        raise ValueError(f"{name}={text!r} must be <= {most}")
    return value


def _choice(environ: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    text = environ.get(name)
    if text is None or text == "":
        return default
    if text not in choices:
        raise ValueError(f"{name}={text!r} must be one of {', '.join(choices)}")
    return text


def _cpus(environ: Mapping[str, str], name: str) -> str:
    text = (environ.get(name) or "").strip()
    if text and text != "auto":
        try:
            parse_cpu_list(text)
        except ValueError as err:
            raise ValueError(f"{name}={text!r} must be 'auto' or a CPU list like 0-3,8: {err}") from None
    return text


BIND_HOST_VAR = "NCCLKV_BIND_HOST"
# vLLM's own layers-per-stage override ("a,b,..."; vllm.distributed.utils.get_pp_indices reads it). The connector
# takes vLLM's split from vLLM itself; ``ncclkv plan`` reads it from the mapping it is given to split as vLLM would.
PP_PARTITION_VAR = "VLLM_PP_LAYER_PARTITION"
# Gloo's interface between nodes (torch reads it for its own gloo groups). ncclkv's data plane binds to one
# address it is given; with ``--bind-host auto`` the scenario takes this interface's (ncclkv.scenario._common).
GLOO_IFNAME_VAR = "GLOO_SOCKET_IFNAME"


# Bind hosts that listen on every interface: nothing a peer can be told to connect to.
WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::"})


def is_auto_host(text: str | None) -> bool:
    """Whether a bind host (NCCLKV_BIND_HOST, ``--bind-host``) says ``auto``, in any case and spacing."""
    return (text or "").strip().lower() == "auto"


def take_bind_host_auto(environ: MutableMapping[str, str]) -> bool:
    """Take ``NCCLKV_BIND_HOST=auto`` out of ``environ`` (True if it was there), for the scenario entry point.

    That entry point resolves ``auto`` for its rank (it knows MASTER_ADDR) and hands the address to the data
    plane and engine explicitly; left in the environment, every :func:`env_settings` would refuse it.
    """
    if not is_auto_host(environ.get(BIND_HOST_VAR)):
        return False
    del environ[BIND_HOST_VAR]
    return True


def _bind_host(environ: Mapping[str, str], name: str, default: str) -> str:
    text = (environ.get(name) or "").strip()
    if not text:
        return default
    if is_auto_host(text):
        # 'auto' needs MASTER_ADDR to find a route: only the scenario entry point has one (it takes the value
        # out of its own environment before anything reads it here, ncclkv.scenario.__main__).
        raise ValueError(
            f"{name}={text!r}: 'auto' (this host's address on the route to MASTER_ADDR) is understood only by "
            f"python -m ncclkv.scenario and the launch/ scripts; an engine or the vLLM connector binds to an "
            f"address: set {name} to one of this host's addresses")
    return text


PAGED_KERNELS = ("native", "torch")
MAX_COPY_THREADS = 16  # the native kernel's MAX_THREADS


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """Defaults that a deployment may override by environment.

    NCCLKV_DEADLINE_S        deadline of any single wait (default 10 s)
    NCCLKV_HEARTBEAT_S       heartbeat interval on the control channel (default 1 s)
    NCCLKV_BIND_HOST         address control and data sockets bind to (default 127.0.0.1; ``auto`` only for
                             ``python -m ncclkv.scenario``, which resolves it, and is refused here by name)
    NCCLKV_STAGING_BYTES     receive staging capacity per engine (default 1 GiB)
    NCCLKV_WIRE_CACHE_BYTES  most free wire buffers an engine rank keeps for reuse, CPU (default 256 MiB;
                             below it, at most twice the most bytes out at once lately; 0: none)
    NCCLKV_MAX_FRAME_BYTES   largest control frame accepted (default 1 MiB)
    NCCLKV_FUZZ_EXAMPLES     messages the protocol fuzz tests generate in all (default 10000)
    NCCLKV_SOAK_REQUESTS     requests the soak test (tests/soak) sends (default 200; the full soak: 1000)
    NCCLKV_PAGED_KERNEL      how gather/scatter move CPU caches: ``native`` (the C kernel, default) or
                             ``torch`` (torch ops, as on CUDA; for comparison and diagnosis)
    NCCLKV_COPY_THREADS      threads one native gather/scatter call may use, 1-16 (default 1; each gets at least
                             256 KiB of the slice): for hosts whose cores are not all busy with the model
    NCCLKV_CPUS              the CPUs an engine's threads run on: a list like ``14,15`` or ``8-11``, or ``auto``
                             (those OpenMP is not bound to, see ncclkv._affinity); unset: each thread keeps the
                             mask of the thread that started it

    Control-channel authentication (see :mod:`ncclkv.auth`, docs/SECURITY.md; unset: off):
    NCCLKV_CURVE_SECRET_FILE   this rank's zmq.auth ``.key_secret`` certificate
    NCCLKV_CURVE_PUBLIC_FILE   certificate of the server key our DEALERs expect (default: our own)
    NCCLKV_CURVE_ALLOWED_DIR   directory of ``*.key`` certificates of admitted clients (default: our own)
    NCCLKV_CURVE_SECRET_KEY    Z85 secret key, instead of the file
    NCCLKV_CURVE_SERVER_KEY    Z85 server key, with NCCLKV_CURVE_SECRET_KEY
    NCCLKV_CURVE_ALLOWED_KEYS  comma-separated Z85 client keys, with NCCLKV_CURVE_SECRET_KEY
    NCCLKV_SHARED_SECRET_FILE  file holding the HMAC key (>= 32 bytes)
    NCCLKV_SHARED_SECRET       the HMAC key itself, instead of the file
    """

    deadline_s: float = 10.0
    heartbeat_s: float = 1.0
    bind_host: str = "127.0.0.1"
    staging_bytes: int = 1 << 30
    wire_cache_bytes: int = 256 << 20  # as much as a link keeps in flight per direction (transport default)
    max_frame_bytes: int = 1 << 20  # = ncclkv.protocol.DEFAULT_MAX_FRAME_BYTES (not imported: _env stays stdlib-only)
    fuzz_examples: int = 10_000
    soak_requests: int = 200
    paged_kernel: str = "native"
    copy_threads: int = 1
    cpus: str = ""
    curve_secret_file: str = ""
    curve_public_file: str = ""
    curve_allowed_dir: str = ""
    curve_secret_key: str = field(default="", repr=False)
    curve_server_key: str = ""
    curve_allowed_keys: str = ""
    shared_secret_file: str = ""
    shared_secret: str = field(default="", repr=False)


def env_settings(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """The ``NCCLKV_*`` values of ``environ`` (default: ``os.environ`` as it is now), each checked (a ValueError
    names a bad one)."""
    env = os.environ if environ is None else environ
    # An instance, not the class: on a slots dataclass the class attributes are member descriptors.
    default = EnvSettings()
    return EnvSettings(
        deadline_s=_seconds(env, "NCCLKV_DEADLINE_S", default.deadline_s),
        heartbeat_s=_seconds(env, "NCCLKV_HEARTBEAT_S", default.heartbeat_s),
        bind_host=_bind_host(env, BIND_HOST_VAR, default.bind_host),
        staging_bytes=_int(env, "NCCLKV_STAGING_BYTES", default.staging_bytes),
        wire_cache_bytes=_int(env, "NCCLKV_WIRE_CACHE_BYTES", default.wire_cache_bytes, least=0),  # 0: keep none
        max_frame_bytes=_int(env, "NCCLKV_MAX_FRAME_BYTES", default.max_frame_bytes),
        fuzz_examples=_int(env, "NCCLKV_FUZZ_EXAMPLES", default.fuzz_examples),
        soak_requests=_int(env, "NCCLKV_SOAK_REQUESTS", default.soak_requests),
        paged_kernel=_choice(env, "NCCLKV_PAGED_KERNEL", default.paged_kernel, PAGED_KERNELS),
        copy_threads=_int(env, "NCCLKV_COPY_THREADS", default.copy_threads, most=MAX_COPY_THREADS),
        cpus=_cpus(env, "NCCLKV_CPUS"),
        curve_secret_file=env.get("NCCLKV_CURVE_SECRET_FILE", ""),
        curve_public_file=env.get("NCCLKV_CURVE_PUBLIC_FILE", ""),
        curve_allowed_dir=env.get("NCCLKV_CURVE_ALLOWED_DIR", ""),
        curve_secret_key=env.get("NCCLKV_CURVE_SECRET_KEY", ""),
        curve_server_key=env.get("NCCLKV_CURVE_SERVER_KEY", ""),
        curve_allowed_keys=env.get("NCCLKV_CURVE_ALLOWED_KEYS", ""),
        shared_secret_file=env.get("NCCLKV_SHARED_SECRET_FILE", ""),
        shared_secret=env.get("NCCLKV_SHARED_SECRET", ""),
    )
