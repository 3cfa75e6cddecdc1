"""ncclkv._affinity: CPU lists, what OpenMP is bound to, and NCCLKV_CPUS resolved."""

from __future__ import annotations

import os
import threading

import pytest

from ncclkv._affinity import (
    core_siblings, omp_bound_cpus, parse_cpu_list, pinned, resolve_cpus, usable_cpus, vllm_bound_cpus,
)
from ncclkv._env import env_settings


@pytest.mark.parametrize(("text", "cpus"), [("0", {0}), ("0-3,8", {0, 1, 2, 3, 8}), (" 2 - 4 , 7 ", {2, 3, 4, 7}),
                                            ("5,5", {5})])
def test_cpu_lists(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(("text", "message"), [("", "'' is not a CPU number"), ("a", "'a' is not a CPU number"),
                                               ("3-1", "range 3-1 runs backwards"), ("1,,2", "'' is not"),
                                               ("-1", "'-1' is not")])
def test_bad_cpu_lists_name_the_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"CPU list {text!r}: {message}"):
        parse_cpu_list(text)


@pytest.mark.parametrize(("environ", "cpus"), [
    ({"OMP_PLACES": "{0,1,2,3}", "OMP_PROC_BIND": "true"}, {0, 1, 2, 3}),  # what vLLM 0.32 sets
    ({"OMP_PLACES": "{0},{1},{4}", "OMP_PROC_BIND": "close"}, {0, 1, 4}),
    ({"OMP_PLACES": "{0:4}", "OMP_PROC_BIND": "true"}, {0, 1, 2, 3}),
    ({"OMP_PLACES": "{0:3:2}", "OMP_PROC_BIND": "true"}, {0, 2, 4}),
    ({"OMP_PLACES": "{0,1}"}, None),  # places without OMP_PROC_BIND bind nothing
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "false"}, None),
    ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, None),  # abstract names: not ours to resolve
    ({"GOMP_CPU_AFFINITY": "0 1 2 5"}, {0, 1, 2, 5}),
    ({"GOMP_CPU_AFFINITY": "0-3"}, {0, 1, 2, 3}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3,6]"}, {2, 3, 6}),
    ({}, None),
    # forms not parsed are refused whole: a partial set would hand out CPUs OpenMP uses
    ({"OMP_PLACES": "{0:4}:4:4", "OMP_PROC_BIND": "true"}, None),  # replicated places: 16 CPUs
    ({"OMP_PLACES": "{0,1},!{3}", "OMP_PROC_BIND": "true"}, None),
    ({"GOMP_CPU_AFFINITY": "0 3 1-2 4-15:2"}, None),  # a stride
])
def test_what_openmp_is_bound_to(environ: dict[str, str], cpus: set[int] | None) -> None:
    assert omp_bound_cpus(environ) == cpus


def test_resolving_ncclkv_cpus() -> None:
    bound = {"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}
    four = frozenset(range(4))
    assert resolve_cpus("", bound, four) is None
    assert resolve_cpus("6-7", bound, four) == {6, 7}
    assert resolve_cpus("auto", bound, four) == {3}  # the core OpenMP was not given
    assert resolve_cpus("auto", {}, four) is None  # nothing bound: threads keep their masks
    assert resolve_cpus("auto", bound, frozenset({0, 1, 2})) is None  # bound to every CPU this process may use


def test_auto_leaves_out_core_siblings_and_every_local_ranks_list() -> None:
    # 4 cores x 2 threads (cpu n and n + 4 share a core); vLLM's x86 auto-bind gives OpenMP one thread per core.
    asked: list[list[int]] = []

    def siblings(cpus):
        asked.append(list(cpus))
        return {c: frozenset({c % 4, c % 4 + 4}) for c in cpus}

    smt = {"OMP_PLACES": "{4,5,6}", "OMP_PROC_BIND": "true"}
    assert resolve_cpus("auto", smt, frozenset(range(8)), siblings) == {3, 7}  # not 0-2, the model's cores
    assert asked == [[4, 5, 6]]  # only the bound CPUs' cores are read
    assert resolve_cpus("auto", {}, frozenset(range(8)), siblings) is None and len(asked) == 1  # nor when none
    # TP=2: this worker's OpenMP has 0-2, the other's 4-6 (VLLM_CPU_OMP_THREADS_BIND names both).
    tp2 = {"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true", "VLLM_CPU_OMP_THREADS_BIND": "0-2|4-6"}
    assert resolve_cpus("auto", tp2, frozenset(range(8))) == {3, 7}
    assert vllm_bound_cpus({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == frozenset()
    assert vllm_bound_cpus({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == frozenset()


def test_the_environment_variable_is_checked() -> None:
    assert env_settings({"NCCLKV_CPUS": "auto"}).cpus == "auto"
    assert env_settings({"NCCLKV_CPUS": "1-2"}).cpus == "1-2"
    assert env_settings({}).cpus == ""
    with pytest.raises(ValueError, match=r"NCCLKV_CPUS='two' must be 'auto' or a CPU list like 0-3,8"):
        env_settings({"NCCLKV_CPUS": "two"})


def test_pinned_moves_the_thread_and_what_it_starts_then_gives_its_mask_back() -> None:
    allowed = os.sched_getaffinity(0)
    target = frozenset({max(allowed)})
    seen: list[set[int]] = []
    with pinned(target):
        inside = os.sched_getaffinity(0)
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join(10)
    assert inside == target and seen == [target]
    assert os.sched_getaffinity(0) == allowed
    with pinned(None):
        assert os.sched_getaffinity(0) == allowed


def test_cpus_that_are_not_there_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"cannot run ncclkv's threads on CPUs 100000 \(NCCLKV_CPUS\)"):
        with pinned(frozenset({100000})):
            pass
    assert os.sched_getaffinity(0)  # unchanged, still usable


def test_this_machines_usable_cpus_and_core_siblings() -> None:
    usable = usable_cpus()
    assert os.sched_getaffinity(0) <= usable  # a thread's mask lies inside the cpuset
    siblings = core_siblings(sorted(usable))
    assert all(cpu in siblings[cpu] for cpu in usable)  # a CPU is a thread of its own core
    assert core_siblings([10**6]) == {10**6: frozenset({10**6})}  # unreadable: the CPU alone
