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
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

__all__ = [
    "core_siblings", "cpus_from_setting", "omp_bound_cpus", "parse_cpu_list", "pin_this_thread", "pinned", "resolve_cpus", "usable_cpus",
    "vllm_bound_cpus",
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


def resolve_cpus(setting: str, environ: Mapping[str, str], candidates: frozenset[int],
                 siblings: Callable[[Iterable[int]], Mapping[int, frozenset[int]]] | None = None,
                 ) -> frozenset[int] | None:
    """What ``NCCLKV_CPUS`` asks for: None (empty: threads keep the mask they start with), a list, or for
    ``auto`` the ``candidates`` (the CPUs this process may use) that neither OpenMP here nor an explicit
    ``VLLM_CPU_OMP_THREADS_BIND`` (every rank's list) is bound to, nor an SMT sibling of one (``siblings``:
    the CPUs of each given CPU's core, asked only for those bound). None, logged, when OpenMP binds nothing
    or leaves nothing."""
    if not setting:
        return None
    if setting != "auto":
        return parse_cpu_list(setting)
    bound = omp_bound_cpus(environ)
    if bound is None:
        log.info("NCCLKV_CPUS=auto: OpenMP binds no CPUs here; ncclkv's threads keep the mask they start with")
        return None
    taken = set(bound | vllm_bound_cpus(environ))
    if siblings is not None:
        for core in siblings(sorted(taken)).values():
            taken |= core
    free = candidates - taken
    if not free:
        log.warning("NCCLKV_CPUS=auto: OpenMP's threads and their core siblings hold every CPU this process may "
                    "use (%s); ncclkv's threads share them", _cpu_text(candidates))
        return None
    return frozenset(free)


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on: the cgroup's effective cpuset where one is readable, else all of
    them (the main thread's own mask may be OpenMP's one core)."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        with contextlib.suppress(OSError, ValueError):
            return parse_cpu_list(Path(path).read_text().strip())
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


def cpus_from_setting(setting: str, environ: Mapping[str, str]) -> frozenset[int] | None:
    """:func:`resolve_cpus` with this machine's usable CPUs and core siblings (read only for ``auto``)."""
    if setting != "auto":
        return resolve_cpus(setting, environ, frozenset())
    return resolve_cpus(setting, environ, usable_cpus(), core_siblings)


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
