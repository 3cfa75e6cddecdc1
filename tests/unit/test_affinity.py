"""ncclkv._affinity: CPU lists, what OpenMP is bound to, and NCCLKV_CPUS resolved."""

from __future__ import annotations

import logging
import os
import sys
import threading
import types
from pathlib import Path

import pytest

from ncclkv import _affinity
from ncclkv._affinity import (
    cgroup_cpuset_file, core_siblings, cpus_from_setting, omp_bound_cpus, parse_cpu_list, pinned, resolve_cpus,
    usable_cpus, vllm_bound_cpus,
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


# -- vLLM's default auto-bind with several local ranks ---------------------------------------


def test_auto_does_not_hand_out_other_local_ranks_cores(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's default (VLLM_CPU_OMP_THREADS_BIND unset or auto) gives each worker only its own OMP_PLACES: with
    TP=2 (vLLM sets LOCAL_WORLD_SIZE=2) the other worker's model cores 4-6 would look free."""
    rank0 = {"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true", "LOCAL_WORLD_SIZE": "2"}
    eight = frozenset(range(8))
    for bind in ({}, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ncclkv._affinity"):
            assert resolve_cpus("auto", {**rank0, **bind}, eight) is None  # not {3, 4, 5, 6, 7}
        warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warning) == 1 and "2 local ranks (LOCAL_WORLD_SIZE, vLLM's config)" in warning[0], warning
        assert "own CPUs (0,1,2)" in warning[0] and f"({bind.get('VLLM_CPU_OMP_THREADS_BIND', 'unset')})" in warning[0]
    # Every rank's list named: auto knows what is taken.
    assert resolve_cpus("auto", {**rank0, "VLLM_CPU_OMP_THREADS_BIND": "0-2|4-6"}, eight) == {3, 7}
    # One local rank: its own list is all OpenMP has.
    assert resolve_cpus("auto", {**rank0, "LOCAL_WORLD_SIZE": "1"}, eight) == {3, 4, 5, 6, 7}
    assert resolve_cpus("5", rank0, eight) == {5}  # a list is taken as given
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='two' is not an integer"):
        resolve_cpus("auto", {**rank0, "LOCAL_WORLD_SIZE": "two"}, eight)


def test_auto_counts_vllms_local_workers_pp_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 sets LOCAL_WORLD_SIZE to the TP size: with TP=1 x PP=2 it says 1, its config says 2 workers."""
    pp2 = {"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true", "LOCAL_WORLD_SIZE": "1"}
    eight = frozenset(range(8))
    assert resolve_cpus("auto", pp2, eight, local_ranks=2) is None
    assert resolve_cpus("auto", pp2, eight, local_ranks=1) == {3, 4, 5, 6, 7}
    assert _affinity.vllm_local_workers() is None or "vllm.config" in sys.modules
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(local_world_size=2, data_parallel_size_local=1))
    fake = types.ModuleType("vllm.config")
    fake.get_current_vllm_config_or_none = lambda: config  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.config", fake)
    assert _affinity.vllm_local_workers() == 2
    config.parallel_config.data_parallel_size_local = 2  # two local DP engines: 4 workers bind OpenMP
    assert _affinity.vllm_local_workers() == 4
    monkeypatch.setattr(_affinity, "usable_cpus", lambda: eight)
    monkeypatch.setattr(_affinity, "core_siblings", lambda cpus: {c: frozenset({c}) for c in cpus})
    monkeypatch.setattr(_affinity, "_refused_by_kernel", lambda cpus: None)  # eight CPUs, on any machine
    assert cpus_from_setting("auto", pp2) is None  # the config's count reaches auto
    fake.get_current_vllm_config_or_none = lambda: None  # type: ignore[attr-defined]  # no config current
    assert _affinity.vllm_local_workers() is None
    assert cpus_from_setting("auto", pp2) == {3, 4, 5, 6, 7}
    # No config current (as when vLLM registers the KV caches), but its distributed state is up: 4 ranks, 2 nodes.
    state = types.ModuleType("vllm.distributed.parallel_state")
    state._WORLD = types.SimpleNamespace(world_size=4)  # type: ignore[attr-defined]
    state._NODE_COUNT = 2  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    assert _affinity.vllm_local_workers() == 2
    assert cpus_from_setting("auto", pp2) is None
    state._WORLD = None  # type: ignore[attr-defined]
    assert _affinity.vllm_local_workers() is None


# -- this process's own cgroup cpuset ----------------------------------------------------------


def _fake_root(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(proc_cgroup)
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    return tmp_path


SLURM_STEP = "system.slice/slurmstepd.scope/job_7/step_0/user/task_0"
ROOT_V2 = {"sys/fs/cgroup/cpuset.cpus.effective": "0-63\n"}


@pytest.mark.parametrize(("proc_cgroup", "files", "found", "cpus"), [
    # cgroup v2, Slurm ConstrainCores: the task's own cgroup, not the machine's root
    (f"0::/{SLURM_STEP}\n", {**ROOT_V2, f"sys/fs/cgroup/{SLURM_STEP}/cpuset.cpus.effective": "8-11\n"},
     f"sys/fs/cgroup/{SLURM_STEP}/cpuset.cpus.effective", {8, 9, 10, 11}),
    # a systemd slice: the leaf has no cpuset controller enabled, its parent's set applies
    ("0::/machine.slice/app.service\n",
     {**ROOT_V2, "sys/fs/cgroup/machine.slice/cpuset.cpus.effective": "2,4\n", "sys/fs/cgroup/machine.slice/app.service/cgroup.procs": ""},
     "sys/fs/cgroup/machine.slice/cpuset.cpus.effective", {2, 4}),
    # a container without its own cgroup namespace: the path is not under the mount, its root is the container's
    ("0::/docker/0123abcd\n", {"sys/fs/cgroup/cpuset.cpus.effective": "0-3\n"},
     "sys/fs/cgroup/cpuset.cpus.effective", {0, 1, 2, 3}),
    # cgroup v1 (and hybrid): the cpuset hierarchy's line wins over v2's
    ("12:cpu,cpuacct:/x\n3:cpuset:/slurm/uid_0/job_7/step_0\n0::/\n",
     {**ROOT_V2, "sys/fs/cgroup/cpuset/cpuset.effective_cpus": "0-63\n",
      "sys/fs/cgroup/cpuset/slurm/uid_0/job_7/step_0/cpuset.effective_cpus": "5,7\n"},
     "sys/fs/cgroup/cpuset/slurm/uid_0/job_7/step_0/cpuset.effective_cpus", {5, 7}),
    ("3:cpuset:/a\n", {"sys/fs/cgroup/cpuset/a/cpuset.cpus": "1-2\n"}, "sys/fs/cgroup/cpuset/a/cpuset.cpus", {1, 2}),
])
def test_the_cpuset_is_this_processs_own_cgroups(tmp_path: Path, proc_cgroup: str, files: dict[str, str], found: str,
                                                  cpus: set[int]) -> None:
    root = _fake_root(tmp_path, proc_cgroup, files)
    assert cgroup_cpuset_file(root) == root / found
    assert usable_cpus(root) == cpus


def test_no_readable_cpuset_is_every_cpu(tmp_path: Path) -> None:
    assert cgroup_cpuset_file(tmp_path) is None  # no proc/self/cgroup
    assert usable_cpus(tmp_path) == frozenset(range(os.cpu_count() or 1))
    root = _fake_root(tmp_path, "0::/a/b\n", {})  # no cpuset file anywhere
    assert cgroup_cpuset_file(root) is None


def test_this_processs_cpuset_holds_its_mask() -> None:
    assert os.sched_getaffinity(0) <= usable_cpus()


def test_auto_cpus_the_kernel_refuses_leave_the_masks(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A cpuset narrower than the one read: the CPUs auto picks are refused (EINVAL); nothing is free, as when OpenMP
    holds every CPU, and the engine still starts."""
    monkeypatch.setattr(_affinity, "usable_cpus", lambda: frozenset({0, 100000}))
    monkeypatch.setattr(_affinity, "core_siblings", lambda cpus: {c: frozenset({c}) for c in cpus})
    bound = {"OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING, logger="ncclkv._affinity"):
        assert cpus_from_setting("auto", bound) is None
    assert os.sched_getaffinity(0) == before  # the probe moved no thread of the caller's
    assert any("chose CPUs 100000, which this process may not run on" in r.getMessage() for r in caplog.records)
    if len(before) >= 2:  # CPUs the kernel takes are taken
        first, last = min(before), max(before)
        monkeypatch.setattr(_affinity, "usable_cpus", lambda: frozenset({first, last}))
        assert cpus_from_setting("auto", {**bound, "OMP_PLACES": f"{{{first}}}"}) == {last}


def test_a_probe_the_kernel_does_not_answer_is_a_refusal_after_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe waits for the kernel at most _PROBE_S: a call that does not return reads as a refusal."""
    release = threading.Event()
    monkeypatch.setattr(_affinity, "_PROBE_S", 0.05)
    monkeypatch.setattr(_affinity.os, "sched_setaffinity", lambda pid, cpus: release.wait(10.0))
    try:
        err = _affinity._refused_by_kernel(frozenset({0}))  # noqa: SLF001
    finally:
        release.set()
    assert isinstance(err, TimeoutError) and "did not return within 0.05 s" in str(err)
