"""Launch discovery on real clusters: container hooks in srun steps, colliding jobs, het steps, --preserve-env and
the batch script, torchrun's MASTER_ADDR, GLOO_SOCKET_IFNAME, the loopback guard, RDZV_ID and stale Open MPI
variables. Environments are the variables the real launchers set (Slurm 22.05 and Open MPI 5 as
tests/launchers sees them, pyxis/enroot's slurm-pytorch hook as it is written); the real launchers run in
tests/launchers/test_cluster_envs.py.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ncclkv.launch import LaunchInfo, discover, first_slurm_host, free_port, slurm_hostlist
from ncclkv.scenario import _common, _ring, _transfer
from ncclkv.scenario.__main__ import main
from ncclkv.scenario._common import resolve_bind_host, resolve_device
from ncclkv.scenario._rendezvous import ForeignStoreError, StoreRendezvous, job_identity

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0


def srun_task(rank: int, *, tasks: int = 4, nodes: int = 2, step: int = 1, job: int = 4242, **extra: str) -> dict[str, str]:
    """Task ``rank`` of ``srun -N nodes -n tasks --gpus-per-task=1`` (step ``step`` of job ``job``), as Slurm 22.05
    sets it (every node runs tasks // nodes)."""
    per_node = tasks // nodes
    env = {
        "SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_STEP_ID": str(step), "SLURM_STEPID": str(step),
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node),
        "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_NNODES": str(nodes), "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
        "SLURM_JOB_NODELIST": f"gpu[07-{7 + nodes - 1:02d}]" if nodes > 1 else "gpu07",
        "SLURM_STEP_NODELIST": f"gpu[07-{7 + nodes - 1:02d}]" if nodes > 1 else "gpu07",
        "SLURMD_NODENAME": f"gpu{7 + rank // per_node:02d}", "SLURMD_TRES_BIND": "gpu:per_task:1",
    }
    env.update(extra)
    return env


def pyxis(env: dict[str, str], master: str = "gpu07") -> dict[str, str]:
    """What enroot's slurm-pytorch hook (pyxis containers) adds to every srun task: one port per job."""
    return {**env, "RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"],
            "MASTER_ADDR": master, "MASTER_PORT": str(int(env["SLURM_JOB_ID"]) % 16384 + 49152)}


def refused(env: dict[str, str]) -> str:
    with pytest.raises(ValueError) as err:
        discover(env)
    return str(err.value)


# -- 1. pyxis/enroot: RANK/WORLD_SIZE copied from the srun step ------------------------------------


def test_pyxis_hook_variables_are_read_as_the_slurm_task_they_copy() -> None:
    """Read as the plain 'env' launcher, the node's task count, the GPU binding and the step id were lost."""
    info = discover(pyxis(srun_task(3)))
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 3, 4, 1, 2)
    assert (info.gpus_per_task, info.step_id, info.job_id) == (1, 1, "4242")
    assert (info.master_addr, info.master_port) == ("gpu07", 4242 + 49152)  # the hook's, as given


def test_pyxis_task_with_its_own_gpu_takes_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpus-per-task=1: each task sees its one GPU; read as 'env' (2 local ranks, 1 GPU seen) auto chose the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto", discover(pyxis(srun_task(3)))) == torch.device("cuda", 0)


def test_pyxis_world_size_of_the_job_under_preserve_env_is_refused_naming_both() -> None:
    """srun --preserve-env -n 2 in a 4-task job: the hook's WORLD_SIZE=$SLURM_NTASKS is the job's 4."""
    env = pyxis(srun_task(1, tasks=2, nodes=1, SLURM_NTASKS="4", SLURM_NPROCS="4"))
    text = refused(env)
    assert "WORLD_SIZE=4" in text and "SLURM_STEP_NUM_TASKS=2" in text and "SLURM_PROCID=1" in text, text
    text = refused({**pyxis(srun_task(1)), "RANK": "2"})
    assert "RANK=2" in text and "SLURM_PROCID=1" in text, text
    text = refused({**pyxis(srun_task(3)), "LOCAL_RANK": "0"})
    assert "LOCAL_RANK='0'" in text and "SLURM_LOCALID='1'" in text, text


def test_hand_placed_processes_in_a_one_task_step_stay_env() -> None:
    """``srun --pty bash``, then processes started by hand with their own RANK/WORLD_SIZE: not the step's task."""
    env = {**srun_task(0, tasks=1, nodes=1), "RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "5555"}
    info = discover(env)
    assert (info.launcher, info.rank, info.world_size, info.step_id, info.job_id) == ("env", 1, 2, 0, None)


def test_two_pyxis_steps_on_one_port_meet_refused_not_mixed() -> None:
    """The hook gives every step of a job one MASTER_PORT: step 2's rank meets step 1's store and is refused."""
    step1 = discover(pyxis(srun_task(0, tasks=2, nodes=1, step=1), master="127.0.0.1"))
    step2 = discover(pyxis(srun_task(1, tasks=2, nodes=1, step=2), master="127.0.0.1"))
    assert step1.master_port == step2.master_port
    port = free_port()
    host = StoreRendezvous(LaunchInfo(**{**_fields(step1), "master_port": port}), prefix="t", deadline_s=WAIT_S)
    with pytest.raises(ForeignStoreError, match=r"belongs to another job or step \(slurm job 4242 step 1 world_size 2\)"
                                                r", not to this one \(slurm job 4242 step 2 world_size 2\)"):
        StoreRendezvous(LaunchInfo(**{**_fields(step2), "master_port": port}), prefix="t", deadline_s=WAIT_S)
    del host


def _fields(info: LaunchInfo) -> dict[str, object]:
    return {name: getattr(info, name) for name in LaunchInfo.__dataclass_fields__}


# -- 2. colliding derived ports: job id in the keys, identity checked first -------------------------


def slurm_info(job: str | None, rank: int, port: int, step: int = 0, world: int = 2) -> LaunchInfo:
    return LaunchInfo("slurm", rank, world, rank, world, "127.0.0.1", port, step_id=step, job_id=job)


def test_rendezvous_keys_carry_the_job() -> None:
    port = free_port()
    rendezvous = StoreRendezvous(slurm_info("5000", 0, port, step=3), prefix="ncclkv/scenario/ring", deadline_s=WAIT_S)
    assert rendezvous.prefix == "ncclkv/scenario/ring/job5000/step3/attempt0"
    assert job_identity(slurm_info(None, 0, port)) == "slurm no job id world_size 2"


def test_a_rank_of_another_job_is_refused_at_once_and_writes_nothing() -> None:
    """Jobs 5000 and 17000 derive one port (step 0); job 17000's rank 1 met job 5000's store and took part in its
    exchange (both ranks got each other's addresses)."""
    port = free_port()
    host = StoreRendezvous(slurm_info("5000", 0, port), prefix="p", deadline_s=WAIT_S)
    started = time.monotonic()
    with pytest.raises(ForeignStoreError) as err:
        StoreRendezvous(slurm_info("17000", 1, port), prefix="p", deadline_s=WAIT_S)
    assert time.monotonic() - started < 5, "refused only at the deadline"
    text = str(err.value)
    assert "slurm job 5000 step 0" in text and "slurm job 17000 step 0" in text and "MASTER_PORT" in text, text
    # Job 5000 is untouched: its rank 1 still joins, and the exchange holds job 5000's values only.
    results: dict[int, list[str]] = {}
    thread = threading.Thread(target=lambda: results.setdefault(0, host.exchange("a0")))
    thread.start()
    results[1] = StoreRendezvous(slurm_info("5000", 1, port), prefix="p", deadline_s=WAIT_S).exchange("a1")
    thread.join(WAIT_S)
    assert results == {0: ["a0", "a1"], 1: ["a0", "a1"]}


def test_the_entry_point_exits_2_on_a_foreign_store(tmp_path: Path) -> None:
    """The whole entry point, as srun starts rank 1 of job 17000 on a node where job 5000's rank 0 serves."""
    port = free_port()
    host = StoreRendezvous(slurm_info("5000", 0, port), prefix="ncclkv/scenario/ring", deadline_s=WAIT_S)
    env = {key: value for key, value in os.environ.items() if not key.startswith(_LAUNCHER_PREFIXES)}
    env.update(srun_task(1, tasks=2, nodes=1, step=0, job=17000, SLURMD_TRES_BIND="", SLURM_STEP_NODELIST="127.0.0.1",
                         SLURM_JOB_NODELIST="127.0.0.1", SLURMD_NODENAME="127.0.0.1"))
    env["MASTER_PORT"] = str(port)  # the derived one collides; the test's own free port stands in for it
    done = subprocess.run([sys.executable, "-m", "ncclkv.scenario", "--kind", "ring", "--small", "--deadline", "60"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    del host
    assert done.returncode == 2, done.stderr
    assert "rank 1: rendezvous refused:" in done.stderr and "slurm job 5000 step 0" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def open_mpi_rank(rank: int, namespace: str, world: int = 2) -> dict[str, str]:
    """Rank ``rank`` of ``mpiexec -n world`` started by a one-node batch script, as Open MPI 5 sets it (PMIx names
    each mpiexec run: prterun-<host>-<pid>@1)."""
    return {**BATCH_STEP, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(world),
            "PMIX_RANK": str(rank), "PMIX_NAMESPACE": namespace}


def assert_own_rank_joins(host: StoreRendezvous, own: LaunchInfo, on_port: dict[str, object]) -> None:
    """The hosting rank's own rank 1 (``own``) joins its exchange, and both finish."""
    results: dict[int, list[str]] = {}
    thread = threading.Thread(target=lambda: (results.setdefault(0, host.exchange("a0")), host.finish()))
    thread.start()
    peer = StoreRendezvous(LaunchInfo(**{**_fields(own), **on_port}), prefix="p", deadline_s=WAIT_S)
    results[1] = peer.exchange("a1")
    peer.finish()
    thread.join(WAIT_S)
    assert results == {0: ["a0", "a1"], 1: ["a0", "a1"]}


def test_two_mpiexec_runs_on_one_port_are_refused_not_mixed() -> None:
    """Two mpiexec runs of one batch script derive one MASTER_PORT from SLURM_JOB_ID (two runs given one exported
    port do too): the second run's rank 1 met the first run's store under the same identity ('openmpi no job id
    world_size 2'), joined its exchange and its link ring.0-1, and reported its failure there: the first run, healthy,
    exited 3 ('rank 1 failed: ... link rank 1 already joined')."""
    first = discover(open_mpi_rank(0, "prterun-vm-27999@1"))
    second = discover(open_mpi_rank(1, "prterun-vm-29658@1"))
    assert (first.launcher, first.master_port) == ("openmpi", second.master_port)  # derived from SLURM_JOB_ID=1
    port = free_port()
    on_port = {"master_addr": "127.0.0.1", "master_port": port}
    host = StoreRendezvous(LaunchInfo(**{**_fields(first), **on_port}), prefix="p", deadline_s=WAIT_S)
    with pytest.raises(ForeignStoreError) as err:
        StoreRendezvous(LaunchInfo(**{**_fields(second), **on_port}), prefix="p", deadline_s=WAIT_S)
    text = str(err.value)
    assert "prterun-vm-27999@1" in text and "prterun-vm-29658@1" in text and "MASTER_PORT" in text, text
    # The first run is untouched: its own rank 1 joins, and both finish.
    assert_own_rank_joins(host, discover(open_mpi_rank(1, "prterun-vm-27999@1")), on_port)


def hydra_rank(rank: int, job: int, world: int = 2) -> dict[str, str]:
    """Rank ``rank`` of MPICH's ``mpiexec -n world`` (Hydra) started by a one-node batch script of job ``job``."""
    return {**BATCH_STEP, "SLURM_JOB_ID": str(job), "PMI_RANK": str(rank), "PMI_SIZE": str(world),
            "MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": str(world)}


@pytest.mark.parametrize("launcher", ["mpich", "env"])
def test_other_launchers_of_jobs_whose_derived_ports_collide_are_refused_not_mixed(launcher: str) -> None:
    """Jobs 5000 and 17000 derive one MASTER_PORT from SLURM_JOB_ID under Hydra's mpiexec or hand-placed RANK and
    WORLD_SIZE too, but their identity carried no job ('mpich no job id world_size 2'): job 17000's rank 1 met job
    5000's store and joined its exchange."""
    def rank_env(rank: int, job: int) -> dict[str, str]:
        if launcher == "mpich":
            return hydra_rank(rank, job)
        return {**BATCH_STEP, "SLURM_JOB_ID": str(job), "RANK": str(rank), "WORLD_SIZE": "2"}

    first, second = discover(rank_env(0, 5000)), discover(rank_env(1, 17000))
    assert (first.launcher, first.master_port) == (launcher, second.master_port)  # derived from the job ids
    on_port = {"master_addr": "127.0.0.1", "master_port": free_port()}
    host = StoreRendezvous(LaunchInfo(**{**_fields(first), **on_port}), prefix="p", deadline_s=WAIT_S)
    with pytest.raises(ForeignStoreError) as err:
        StoreRendezvous(LaunchInfo(**{**_fields(second), **on_port}), prefix="p", deadline_s=WAIT_S)
    text = str(err.value)
    assert f"{launcher} job 5000 step 0" in text and f"{launcher} job 17000 step 0" in text, text
    # Job 5000 is untouched: its own rank 1 joins, and both finish.
    assert_own_rank_joins(host, discover(rank_env(1, 5000)), on_port)


def test_an_exported_master_port_keeps_other_launchers_without_a_job() -> None:
    """Ranks given MASTER_PORT may run where no Slurm variable is (ssh to another node): no job in the identity."""
    info = discover({**hydra_rank(1, 5000), "MASTER_PORT": "29500"})
    assert (info.launcher, info.job_id, info.step_id) == ("mpich", None, 0)


_LAUNCHER_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_",
                      "MASTER_ADDR", "MASTER_PORT", "OMPI_", "PMI", "MPI_LOCAL", "SLURM", "NCCLKV_", "GLOO_")


# -- 3. heterogeneous steps: task 0 is het group 0's first task --------------------------------------


HET_STEP = {  # srun --het-group=0,1: group 0 on gpu[20-21], group 1 on gpu[03-04]; the step's list is sorted
    "SLURM_JOB_ID": "11741", "SLURM_HET_SIZE": "2", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "gpu[03-04,20-21]", "SLURM_JOB_NODELIST": "gpu[03-04,20-21]",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu[20-21]", "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu[03-04]",
    "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
}


@pytest.mark.parametrize(("rank", "node"), [(0, "gpu20"), (1, "gpu21"), (2, "gpu03")])
def test_het_step_master_is_het_group_0s_first_node(rank: int, node: str) -> None:
    env = {**HET_STEP, "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "SLURMD_NODENAME": node}
    assert discover(env).master_addr == "gpu20"


def test_rank_0_off_the_derived_node_is_refused_naming_both() -> None:
    """Without the het group's list (or another mismatch) rank 0 finds it is not where the others look."""
    env = {key: value for key, value in HET_STEP.items() if not key.startswith("SLURM_JOB_NODELIST_HET")}
    env.update({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "gpu20"})
    text = refused(env)
    assert "SLURMD_NODENAME='gpu20'" in text and "'gpu03'" in text and "export MASTER_ADDR" in text, text
    assert discover({**env, "MASTER_ADDR": "10.0.0.20"}).master_addr == "10.0.0.20"  # given: nothing derived
    assert discover({**env, "SLURM_PROCID": "2", "SLURMD_NODENAME": "gpu03"}).master_addr == "gpu03"  # not rank 0


def test_a_step_on_het_group_1_alone_keeps_its_own_first_node() -> None:
    """srun --het-group=1 inherits the job's SLURM_JOB_NODELIST_HET_GROUP_0, but runs elsewhere."""
    env = {**HET_STEP, "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "gpu03"}
    assert discover(env).master_addr == "gpu03"


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("gpu[01-03]-ib", ["gpu01-ib", "gpu02-ib", "gpu03-ib"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n[1-2]-ib,n[3-4]", ["n1-ib", "n2-ib", "n3", "n4"]),
    ("gpu[03-04,20],cpu1", ["gpu03", "gpu04", "gpu20", "cpu1"]),
    ("node1.cluster.local", ["node1.cluster.local"]),
    ("x[8-10]", ["x8", "x9", "x10"]),
])
def test_hostlists_with_suffixes_and_several_ranges(nodelist: str, hosts: list[str]) -> None:
    """The first host of 'gpu[01-04]-ib' was 'gpu01' (the suffix dropped), of 'rack[1-2]-n[01-02]' 'rack1'."""
    assert slurm_hostlist(nodelist) == hosts
    assert first_slurm_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist", ["", "gpu[01-02", "gpu01]", "gpu[a-b]", "gpu[3-1]", "a,,b"])
def test_malformed_hostlists_are_named(nodelist: str) -> None:
    with pytest.raises(ValueError, match="Slurm node list"):
        slurm_hostlist(nodelist)


# -- 4. the step's world, not the job's; the batch script itself ------------------------------------


def test_preserve_env_world_is_the_steps() -> None:
    """srun --preserve-env -n 2 inside sbatch --ntasks=4 keeps SLURM_NTASKS=4 (the job's): ranks waited for 4."""
    env = srun_task(1, tasks=2, nodes=1, SLURM_NTASKS="4", SLURM_NPROCS="4", SLURM_TASKS_PER_NODE="4")
    info = discover(env)
    assert (info.launcher, info.rank, info.world_size, info.local_world_size) == ("slurm", 1, 2, 2)


# The batch step of `sbatch --ntasks=4` as Slurm 22.05 sets it (no SLURM_STEP_*).
BATCH_STEP = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "vm", "SLURM_LOCALID": "0", "SLURM_NNODES": "1",
              "SLURM_NODEID": "0", "SLURM_NPROCS": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
              "SLURM_TASKS_PER_NODE": "4"}


def test_the_batch_script_itself_is_told_to_launch_with_srun() -> None:
    text = refused(BATCH_STEP)
    assert "SLURM_STEP_NUM_TASKS is not" in text and "SLURM_NTASKS='4'" in text and "launch with srun" in text, text
    assert "launch with srun" in refused({"SLURM_PROCID": "0", "SLURM_JOB_ID": "1"})  # sbatch without --ntasks
    # mpiexec or torchrun inside the batch script: their own variables win, as before.
    assert discover({**BATCH_STEP, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                     "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                     "MASTER_PORT": "5555"}).launcher == "openmpi"


def test_the_batch_script_is_a_usage_error_of_the_entry_point(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """It waited out the deadline and exited 3, a peer failure."""
    for key in list(os.environ):
        if key.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(key)
    for key, value in BATCH_STEP.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(_ring, "run", lambda info, checked: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exited:
        main(["--kind", "ring", "--small"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "launch with srun" in err and "Traceback" not in err, err


# -- 5. torchrun's MASTER_ADDR: the fix is --local-addr ---------------------------------------------


TORCHRUN_2X2 = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "localhost", "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_torchrun_loopback_refusal_names_local_addr() -> None:
    """torchrun overwrites MASTER_ADDR (with --local-addr, else getfqdn()): 'set MASTER_ADDR' could not be followed."""
    with pytest.raises(ValueError) as err:
        resolve_bind_host("auto", discover(TORCHRUN_2X2), {})
    text = str(err.value)
    assert "--local-addr" in text and "LOCAL_ADDR" in text and "set MASTER_ADDR" not in text, text


def pd_script_argv(tmp_path: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run launch/``script`` with PYTHON a stand-in that writes its arguments one per line to ``tmp_path/argv``."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
    fake.chmod(0o755)
    base = {key: value for key, value in os.environ.items()
            if not key.startswith(("SLURM_", "NCCLKV_", "NNODES", "RDZV_", "LOCAL_ADDR", "PYTHON"))}
    full = {**base, "PYTHON": str(fake), "ARGV_OUT": str(tmp_path / "argv"), **env}
    return subprocess.run(["bash", str(REPO / "launch" / script), *args], env=full, capture_output=True, text=True,
                          timeout=30, cwd=REPO)


def test_torchrun_pd_passes_local_addr(tmp_path: Path) -> None:
    done = pd_script_argv(tmp_path, "torchrun_pd.sh", LOCAL_ADDR="10.0.0.7")
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[argv.index("--local-addr") + 1] == "10.0.0.7", argv
    done = pd_script_argv(tmp_path, "torchrun_pd.sh")
    assert done.returncode == 0 and "--local-addr" not in (tmp_path / "argv").read_text(), done.stderr


# -- 8. torchrun's rendezvous id: one per job -------------------------------------------------------


def test_torchrun_pd_multi_node_needs_a_rendezvous_id(tmp_path: Path) -> None:
    """It defaulted to 'ncclkv-pd': two jobs at one endpoint joined one rendezvous."""
    done = pd_script_argv(tmp_path, "torchrun_pd.sh", NNODES="2", RDZV_ENDPOINT="h0:29400")
    assert done.returncode == 2 and "RDZV_ID" in done.stderr and "SLURM_JOB_ID" in done.stderr, done.stderr
    assert not (tmp_path / "argv").exists()

    def rdzv_id(**env: str) -> str:
        done = pd_script_argv(tmp_path, "torchrun_pd.sh", NNODES="2", RDZV_ENDPOINT="h0:29400", **env)
        assert done.returncode == 0, done.stderr
        argv = (tmp_path / "argv").read_text().splitlines()
        return argv[argv.index("--rdzv-id") + 1]

    assert rdzv_id(SLURM_JOB_ID="777") == "777"
    assert rdzv_id(SLURM_JOB_ID="777", RDZV_ID="mine") == "mine"
    done = pd_script_argv(tmp_path, "torchrun_pd.sh")  # one node: --standalone makes its own id
    argv = (tmp_path / "argv").read_text().splitlines()
    assert done.returncode == 0 and "--standalone" in argv and "--rdzv-id" not in argv, argv


def test_torchrun_pd_multi_node_needs_an_endpoint(tmp_path: Path) -> None:
    done = pd_script_argv(tmp_path, "torchrun_pd.sh", NNODES="2", RDZV_ID="x")
    assert done.returncode == 2 and "RDZV_ENDPOINT" in done.stderr, done.stderr


# -- 6. GLOO_SOCKET_IFNAME steers --bind-host auto ---------------------------------------------------


def one_node(world: int = 2, master: str = "127.0.0.1") -> LaunchInfo:
    return LaunchInfo("env", 0, world, 0, world, master, 29500)


def test_gloo_socket_ifname_gives_the_interfaces_address() -> None:
    """The route to MASTER_ADDR decided alone: GLOO_SOCKET_IFNAME, which the templates tell operators to set, did
    not steer the data plane. TEST-NET-2's 198.51.100.1 routes out of a non-loopback interface; lo is named."""
    info = one_node(master="198.51.100.1")
    assert resolve_bind_host("auto", info, {"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert resolve_bind_host("auto", info, {"GLOO_SOCKET_IFNAME": " lo "}) == "127.0.0.1"


def test_gloo_socket_ifname_on_loopback_is_refused_across_nodes() -> None:
    info = LaunchInfo("env", 0, 4, 0, 2, "198.51.100.1", 29500)
    with pytest.raises(ValueError, match=r"found loopback 127\.0\.0\.1 \(GLOO_SOCKET_IFNAME=lo\).*spans several nodes"):
        resolve_bind_host("auto", info, {"GLOO_SOCKET_IFNAME": "lo"})


def test_gloo_socket_ifname_that_does_not_exist_is_named() -> None:
    with pytest.raises(ValueError, match=r"GLOO_SOCKET_IFNAME='nosuch0': this host has no network interface 'nosuch0' "
                                         r"\(it has .*lo"):
        resolve_bind_host("auto", one_node(), {"GLOO_SOCKET_IFNAME": "nosuch0"})


def test_gloo_socket_ifname_without_ipv4_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_address(*args: object) -> bytes:
        raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))

    monkeypatch.setattr(_common.fcntl, "ioctl", no_address)
    with pytest.raises(ValueError, match=r"GLOO_SOCKET_IFNAME='lo': interface 'lo' has no IPv4 address"):
        resolve_bind_host("auto", one_node(), {"GLOO_SOCKET_IFNAME": "lo"})


def test_gloo_socket_ifname_list_must_hold_the_routes_interface() -> None:
    """Several names (gloo's multi-device form): the route's address must be one of theirs."""
    assert resolve_bind_host("auto", one_node(), {"GLOO_SOCKET_IFNAME": "lo,nosuch0"}) == "127.0.0.1"
    with pytest.raises(ValueError, match=r"names several interfaces \(lo: 127\.0\.0\.1, nosuch0: no IPv4 address\)"):
        resolve_bind_host("auto", one_node(master="198.51.100.1"), {"GLOO_SOCKET_IFNAME": "lo,nosuch0"})


def test_an_explicit_bind_host_wins_over_gloo_socket_ifname() -> None:
    assert resolve_bind_host("127.0.0.1", one_node(), {"GLOO_SOCKET_IFNAME": "nosuch0"}) == "127.0.0.1"


def test_a_missing_gloo_interface_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for key in list(os.environ):
        if key.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(key)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "nosuch0"}.items():
        monkeypatch.setenv(key, value)
    for module in (_ring, _transfer):
        monkeypatch.setattr(module, "run", lambda info, checked: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exited:
        main(["--kind", "ring", "--small", "--bind-host", "auto"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "GLOO_SOCKET_IFNAME='nosuch0'" in err, err


# -- 7. the loopback guard when the node's rank count is unknown -------------------------------------


def test_loopback_with_no_node_count_is_refused_naming_the_variable() -> None:
    """The guard needed local_world_size: without it 127.0.0.1 was bound on a two-node job."""
    # The env launcher on 2 nodes: LOCAL_RANK but no LOCAL_WORLD_SIZE; srun's own SLURM_STEP_NUM_NODES says 2.
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    info = discover(env)
    assert info.local_world_size is None
    with pytest.raises(ValueError, match=r"spans several nodes \(SLURM_STEP_NUM_NODES=2\)"):
        resolve_bind_host("auto", info, {"SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2"})
    with pytest.raises(ValueError, match=r"nothing says that all 4 ranks run on this node \(LOCAL_WORLD_SIZE is not set; "
                                         r"on one node set LOCAL_WORLD_SIZE=4\)"):
        resolve_bind_host("auto", info, {})
    # Open MPI without its local size.
    ompi = discover({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_LOCAL_SIZE is not set"):
        resolve_bind_host("auto", ompi, {})


def test_loopback_on_one_known_node_is_allowed() -> None:
    info = discover({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": "29500"})
    assert resolve_bind_host("auto", info, {"SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "3"}) == "127.0.0.1"
    assert resolve_bind_host("auto", info, {"SLURM_NNODES": "1"}) == "127.0.0.1"
    assert resolve_bind_host("auto", one_node(4), {}) == "127.0.0.1"  # local_world_size == world_size


# -- lower: Open MPI variables inherited by an srun step ------------------------------------------------


def test_stale_open_mpi_variables_in_an_srun_step_are_refused() -> None:
    """``mpiexec -n 1 srun -n 2 ...``: both tasks read the one mpiexec rank's OMPI_COMM_WORLD_RANK=0 SIZE=1, as
    Open MPI 5 and Slurm 22.05 set them here (tests/launchers runs it for real)."""
    ompi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-vm-11336@1"}
    for rank in (0, 1):
        text = refused({**srun_task(rank, tasks=2, nodes=1, step=0), **ompi})
        assert "OMPI_COMM_WORLD_SIZE=1" in text and "SLURM_STEP_NUM_TASKS=2" in text, text
    # srun --mpi=pmix gives each task its own PMIX_RANK.
    text = refused({**srun_task(1, tasks=2, nodes=1, step=0), **ompi, "PMIX_RANK": "1"})
    assert "PMIX_RANK=1" in text and "OMPI_COMM_WORLD_RANK=0" in text, text
    # mpiexec inside an sbatch script (no step) or a one-task step (srun --pty bash): Open MPI's ranks, as before.
    four = {**ompi, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "PMIX_RANK": "3", "MASTER_PORT": "5555"}
    assert discover({**BATCH_STEP, **four}).rank == 3
    assert discover({**srun_task(0, tasks=1, nodes=1), **four}).rank == 3


def test_interfaces_listed_by_the_kernel_resolve() -> None:
    """interface_ipv4 agrees with a socket bound to the address it returns (every interface with IPv4)."""
    for _, name in socket.if_nameindex():
        try:
            address = _common.interface_ipv4(name)
        except ValueError:
            continue
        with socket.socket() as sock:
            sock.bind((address, 0))
