"""Which CPUs ncclkv's threads run on (``NCCLKV_CPUS``), and pinning them there.

A thread starts with the CPU mask of the thread that started it. Under vLLM on
a CPU, OpenMP binds the worker's main thread to the first core of its list
(``OMP_PLACES`` with ``OMP_PROC_BIND=true``, set from
``VLLM_CPU_OMP_THREADS_BIND``), so every thread started from it afterwards,
ncclkv's link, channel, executor and copy threads included, would share that
one core with the model's first OpenMP thread. vLLM 0.32 leaves a core per
worker out of its OpenMP lists for a KV connector in P/D set-ups; ``auto``
finds the cores OpenMP was not given, a list names them outright.

Parsing is pure (no system calls); :func:`pinned` and :func:`pin_this_thread`
change the calling thread's mask.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

__all__ = [
    "cgroup_cpuset_file", "core_siblings", "cpus_from_setting", "omp_bound_cpus", "parse_cpu_list", "pin_this_thread",
    "pinned", "resolve_cpus", "usable_cpus", "vllm_bound_cpus", "vllm_local_workers",
]

log = logging.getLogger(__name__)

_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")
_PLACE = re.compile(r"\{([^{}]*)\}")


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}; ValueError naming ``text`` for anything else (empty included)."""
    cpus: set[int] = set()
    for part in text.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"CPU list {text!r}: {part.strip()!r} is not a CPU number or a range like 2-5")
        first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if last < first:
            raise ValueError(f"CPU list {text!r}: range {first}-{last} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _omp_places(text: str) -> frozenset[int] | None:
    """The CPUs of explicit ``OMP_PLACES`` like ``{0,1,2}`` or ``{0},{1}`` or ``{0:4}`` (start:count[:stride]);
    None for abstract names (``cores``, ``threads``), exclusions (``!``), replicated places (``{0:4}:4:4``)
    or anything else: a partial set would hand out CPUs OpenMP uses."""
    places = _PLACE.findall(text)
    if not places or "!" in text or _PLACE.sub("", text).strip(" ,"):
        return None
    cpus: set[int] = set()
    for place in places:
        for item in place.split(","):
            fields = item.strip().split(":")
            if not all(f.strip().isdigit() for f in fields) or len(fields) > 3:
                return None
            start, count, stride = (int(f) for f in (*fields, "1", "1")[:3])
            cpus.update(start + i * stride for i in range(count if len(fields) > 1 else 1))
    return frozenset(cpus)


def omp_bound_cpus(environ: Mapping[str, str]) -> frozenset[int] | None:
    """The CPUs OpenMP binds its threads to, from what vLLM sets (``OMP_PLACES`` with ``OMP_PROC_BIND``,
    ``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``'s proclist); None when none of them binds."""
    places = environ.get("OMP_PLACES", "")
    if places and environ.get("OMP_PROC_BIND", "").lower() not in ("", "false"):
        found = _omp_places(places)
        if found:
            return found
    gomp = environ.get("GOMP_CPU_AFFINITY", "").strip()
    if gomp:  # strides (4-15:2) and other forms: None, not a partial set
        with contextlib.suppress(ValueError):
            return parse_cpu_list(",".join(gomp.replace(",", " ").split()))
    kmp = re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))
    if kmp:
        with contextlib.suppress(ValueError):
            return parse_cpu_list(kmp[1])
    return None


def vllm_bound_cpus(environ: Mapping[str, str]) -> frozenset[int]:
    """Every CPU an explicit ``VLLM_CPU_OMP_THREADS_BIND`` (``0-6|8-14``: a list per local rank) gives to
    OpenMP, other ranks' included; empty for ``auto``, ``nobind`` or nothing."""
    text = environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip()
    if not text or text in ("auto", "nobind"):
        return frozenset()
    cpus: set[int] = set()
    for part in text.split("|"):
        with contextlib.suppress(ValueError):
            cpus |= parse_cpu_list(part)
    return frozenset(cpus)


def _local_world_size(environ: Mapping[str, str]) -> int | None:
    """The processes on this node that bind OpenMP, where the environment says: ``LOCAL_WORLD_SIZE`` (vLLM's CPU
    platform sets it to the tensor-parallel size for its workers; torchrun sets it too)."""
    text = environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={text!r} is not an integer (NCCLKV_CPUS=auto reads it)") from None


def vllm_local_workers() -> int | None:
    """The worker processes vLLM runs on this node, as this process (a vLLM worker) knows them: from the vLLM
    config current here, ``parallel_config.local_world_size`` (TP x PP x PCP on this node) times the local
    data-parallel engines, as its executor counts them; else from its initialized distributed state, the world
    group's size over the node count (what a worker has when it registers its KV caches). None outside vLLM
    (never imported here) or before either is set."""
    config_module = sys.modules.get("vllm.config")
    state = sys.modules.get("vllm.distributed.parallel_state")
    try:
        getter = getattr(config_module, "get_current_vllm_config_or_none", None)
        config = getter() if getter is not None else None
        if config is not None:
            parallel = config.parallel_config
            return int(parallel.local_world_size) * max(1, int(parallel.data_parallel_size_local or 1))
        world, nodes = getattr(state, "_WORLD", None), getattr(state, "_NODE_COUNT", None)
        if world is not None and nodes:
            return max(1, int(world.world_size) // int(nodes))
        return None
    except Exception as err:  # noqa: BLE001 - another vLLM's config: LOCAL_WORLD_SIZE alone decides
        log.warning("NCCLKV_CPUS=auto: cannot read the local worker count from vLLM's config (%s: %s); "
                    "LOCAL_WORLD_SIZE alone says how many local ranks bind OpenMP", type(err).__name__, err)
        return None


def resolve_cpus(setting: str, environ: Mapping[str, str], candidates: frozenset[int],
                 siblings: Callable[[Iterable[int]], Mapping[int, frozenset[int]]] | None = None,
                 local_ranks: int | None = None) -> frozenset[int] | None:
    """What ``NCCLKV_CPUS`` asks for: None (empty: threads keep the mask they start with), a list, or for
    ``auto`` the ``candidates`` (the CPUs this process may use) that neither OpenMP here nor an explicit
    ``VLLM_CPU_OMP_THREADS_BIND`` (every rank's list) is bound to, nor an SMT sibling of one (``siblings``:
    the CPUs of each given CPU's core, asked only for those bound). None, logged, when OpenMP binds nothing
    or leaves nothing, and, with a warning, when other local ranks bind OpenMP to lists this process cannot
    see: ``LOCAL_WORLD_SIZE`` or ``local_ranks`` (:func:`vllm_local_workers`; vLLM 0.32 sets LOCAL_WORLD_SIZE
    to the TP size alone, so PP's workers show only there) > 1 without an explicit ``VLLM_CPU_OMP_THREADS_BIND``
    (vLLM's default ``auto`` puts only this rank's own list in its environment, so the others' cores would look
    free)."""
    if not setting:
        return None
    if setting != "auto":
        return parse_cpu_list(setting)
    bound = omp_bound_cpus(environ)
    if bound is None:
        log.info("NCCLKV_CPUS=auto: OpenMP binds no CPUs here; ncclkv's threads keep the mask they start with")
        return None
    every_rank = vllm_bound_cpus(environ)
    local_size = max(_local_world_size(environ) or 1, local_ranks or 1)
    if not every_rank and local_size > 1:
        bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip() or "unset"
        log.warning("NCCLKV_CPUS=auto: %d local ranks (LOCAL_WORLD_SIZE, vLLM's config) bind OpenMP, but this "
                    "process sees only its "
                    "own CPUs (%s) and VLLM_CPU_OMP_THREADS_BIND (%s) does not list the others', so any other CPU may "
                    "be another rank's model core; ncclkv's threads keep the mask they start with (name the CPUs in "
                    "NCCLKV_CPUS, or every rank's list in VLLM_CPU_OMP_THREADS_BIND)",
                    local_size, _cpu_text(bound), bind)
        return None
    taken = set(bound | every_rank)
    if siblings is not None:
        for core in siblings(sorted(taken)).values():
            taken |= core
    free = candidates - taken
    if not free:
        log.warning("NCCLKV_CPUS=auto: OpenMP's threads and their core siblings hold every CPU this process may "
                    "use (%s); ncclkv's threads share them", _cpu_text(candidates))
        return None
    return frozenset(free)


_V1_CPUSET_FILES = ("cpuset.effective_cpus", "cpuset.cpus")


def cgroup_cpuset_file(root: Path = Path("/")) -> Path | None:
    """The file holding this process's own cgroup's effective cpuset, under ``root`` (``/``; a test's fake tree).

    ``root``/proc/self/cgroup names the cgroup: a v1 ``N:...cpuset...:/path`` line (the cpuset controller's
    hierarchy, at sys/fs/cgroup/cpuset) wins over the v2 ``0::/path`` one (sys/fs/cgroup). A cgroup without
    the file (v2 without the cpuset controller enabled there; a path outside this mount namespace's view, as in a
    container without its own cgroup namespace) has its nearest ancestor's cpuset, which is then read. None when
    nothing is readable."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[Path, tuple[str, ...], str]] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if "cpuset" in controllers.split(","):
            found.insert(0, (root / "sys/fs/cgroup/cpuset", _V1_CPUSET_FILES, path))
        elif hierarchy == "0" and not controllers:
            found.append((root / "sys/fs/cgroup", ("cpuset.cpus.effective",), path))
    for mount, names, path in found:
        here = mount / path.strip().lstrip("/")
        while True:
            for name in names:
                if (here / name).is_file():
                    return here / name
            if here == mount or mount not in here.parents:
                break
            here = here.parent
    return None


def usable_cpus(root: Path = Path("/")) -> frozenset[int]:
    """The CPUs this process may run on: its own cgroup's effective cpuset (:func:`cgroup_cpuset_file`) where one
    is readable, else every CPU, logged. Not the calling thread's mask: under vLLM that is OpenMP's one core."""
    path = cgroup_cpuset_file(root)
    if path is not None:
        try:
            text = path.read_text().strip()
            if text:  # an empty effective set: a v1 cpuset not set up; every CPU, as without one
                return parse_cpu_list(text)
        except (OSError, ValueError) as err:
            log.warning("NCCLKV_CPUS=auto: cannot read this process's cpuset from %s (%s); taking every CPU", path, err)
    else:
        log.info("NCCLKV_CPUS=auto: no cgroup cpuset readable for this process; taking every CPU")
    return frozenset(range(os.cpu_count() or 1))


def core_siblings(cpus: Iterable[int]) -> dict[int, frozenset[int]]:
    """CPU -> the hardware threads of its core, from sysfs (a CPU alone where it cannot be read)."""
    found: dict[int, frozenset[int]] = {}
    for cpu in cpus:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            found[cpu] = parse_cpu_list(path.read_text().strip())
        except (OSError, ValueError):
            found[cpu] = frozenset({cpu})
    return found


_PROBE_S = 5.0  # how long the kernel may take to answer one affinity change


def _refused_by_kernel(cpus: frozenset[int]) -> OSError | None:
    """What the kernel says to moving a thread to ``cpus``, tried on a thread of its own (gone after)."""
    outcome: list[OSError | None] = [None]

    def probe() -> None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as err:
            outcome[0] = err

    thread = threading.Thread(target=probe, name="ncclkv-cpus-probe", daemon=True)
    thread.start()
    thread.join(_PROBE_S)
    if thread.is_alive():  # a system call that does not return: taken as a refusal, never waited for longer
        return TimeoutError(f"sched_setaffinity to {_cpu_text(cpus)} did not return within {_PROBE_S:g} s")
    return outcome[0]


def cpus_from_setting(setting: str, environ: Mapping[str, str]) -> frozenset[int] | None:
    """:func:`resolve_cpus` with this machine's usable CPUs and core siblings (read only for ``auto``).

    ``auto``'s choice is tried first on a thread of its own: where the kernel refuses it (the process's cpuset
    is narrower than it could read, EINVAL), nothing is free for ncclkv, as when OpenMP holds every CPU: a
    warning, and threads keep their masks. A list the kernel refuses is an error, when a thread is pinned."""
    if setting != "auto":
        return resolve_cpus(setting, environ, frozenset())
    cpus = resolve_cpus(setting, environ, usable_cpus(), core_siblings, vllm_local_workers())
    if cpus is not None and (err := _refused_by_kernel(cpus)) is not None:
        log.warning("NCCLKV_CPUS=auto: chose CPUs %s, which this process may not run on (%s; its cpuset is narrower "
                    "than the one read); ncclkv's threads keep the mask they start with", _cpu_text(cpus), err)
        return None
    return cpus


def pin_this_thread(cpus: frozenset[int] | None) -> None:
    """Move the calling thread to ``cpus`` (None: leave it); ValueError naming them if none is usable here."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as err:
        raise ValueError(f"cannot run ncclkv's threads on CPUs {_cpu_text(cpus)} (NCCLKV_CPUS): {err}") from err


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread on ``cpus`` for the block, so threads it starts there inherit them; its own mask
    comes back after."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    pin_this_thread(cpus)
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, before)
        except OSError as err:  # the cpuset shrank meanwhile: never hide what the block raised
            log.warning("could not give this thread its CPUs %s back: %s", _cpu_text(frozenset(before)), err)


def _cpu_text(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
