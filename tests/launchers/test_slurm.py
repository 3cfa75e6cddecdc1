"""srun and sbatch on a one-node Slurm started by the session fixture (conftest.py), for real."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from _launch import REPO, SLURM_TIME_LIMIT, SlurmCluster, ring_lines, run, sbatch_wait, unused_port

from ncclkv.launch import derived_master_port
from ncclkv.layout import ParallelLayout
from ncclkv.scenario import PDTopology

pytestmark = pytest.mark.slurm

TIMEOUT_S = 150
TEMPLATES = sorted((REPO / "slurm").glob("pd_*.sbatch"))


def template_topology(text: str) -> tuple[int, PDTopology]:
    """The task count and P/D set a template asks for, read from its own lines."""
    ntasks = int(re.search(r"^#SBATCH --ntasks=(\d+)$", text, re.M).group(1))
    sizes = {name: int(value) for name, value in re.findall(r"--(prefill|prefill-tp|prefill-pp|decode|decode-tp|decode-pp) (\d+)", text)}
    topology = PDTopology(
        sizes["prefill"], ParallelLayout(sizes["prefill-tp"], sizes["prefill-pp"]),
        sizes["decode"], ParallelLayout(sizes["decode-tp"], sizes["decode-pp"]),
    )
    return ntasks, topology


# Each task prints what discover() made of the variables this Slurm really sets.
PRINT_DISCOVERY = (
    "import json; from ncclkv.launch import discover; i = discover(); "
    "print('DISCOVERED', json.dumps([i.rank, i.launcher, i.local_rank, i.local_world_size, i.gpus_per_task]))"
)


@pytest.mark.parametrize(
    ("options", "launcher", "gpus_per_task"),
    [
        (["--gpus-per-task=1"], "slurm", 1),  # sets no SLURM_GPUS_PER_TASK, only the binding
        (["--gpus-per-task=1", "--gpu-bind=none"], "slurm", None),  # the tasks share the node's GPUs
        (["--mpi=pmi2"], "slurm", None),  # PMI_RANK/PMI_SIZE without MPICH's local variables
    ],
    ids=["gpus-per-task", "gpu-bind-none", "pmi2"],
)
def test_discover_reads_what_srun_sets(slurm: SlurmCluster, options: list[str], launcher: str,
                                       gpus_per_task: int | None) -> None:
    command = ["srun", "-n", "3", *options, f"--time={SLURM_TIME_LIMIT}", sys.executable, "-c", PRINT_DISCOVERY]
    done = run(command, env=slurm.env, timeout_s=TIMEOUT_S)
    assert done.returncode == 0, done.describe()
    seen = sorted(json.loads(line) for line in re.findall(r"^DISCOVERED (.*)$", done.output, re.M))
    assert seen == [[rank, launcher, rank, 3, gpus_per_task] for rank in range(3)], done.describe()


def test_srun_pmix_runs_the_ring(slurm: SlurmCluster) -> None:
    env = {**slurm.env, "MASTER_PORT": str(unused_port())}
    command = [
        "srun", "-n", "4", "--mpi=pmix", f"--time={SLURM_TIME_LIMIT}",
        sys.executable, "-m", "ncclkv.scenario", "--kind", "ring", "--count", "8", "--nbytes", "262144",
    ]
    done = run(command, env=env, timeout_s=TIMEOUT_S)
    print(f"srun -n 4 --mpi=pmix ring: {done.elapsed_s:.1f} s")
    assert done.returncode == 0, done.describe()
    lines = ring_lines(done.output)
    assert sorted(lines) == [0, 1, 2, 3], done.describe()
    assert all("(slurm, cpu)" in line and "8 received byte-exact" in line for line in lines.values()), lines


def test_srun_without_master_port_derives_it_from_the_job_id(slurm: SlurmCluster) -> None:
    """The set-up users get from launch/srun_pd.sh: no MASTER_PORT, so every rank derives the same one, from the
    job id and the step id (steps of one job get ports of their own)."""
    env = {name: value for name, value in slurm.env.items() if name not in ("MASTER_ADDR", "MASTER_PORT")}
    report_job = 'echo "rank $SLURM_PROCID job $SLURM_JOB_ID step $SLURM_STEP_ID"; exec "$0" -m ncclkv.scenario "$@"'
    command = ["srun", "-n", "4", "--mpi=pmix", f"--time={SLURM_TIME_LIMIT}", "bash", "-c", report_job,
               sys.executable, "--kind", "ring", "--count", "4", "--nbytes", "65536"]
    done = run(command, env=env, timeout_s=TIMEOUT_S)
    print(f"srun -n 4 ring, port from the job id: {done.elapsed_s:.1f} s")
    assert done.returncode == 0, done.describe()
    steps = set(re.findall(r"rank \d job (\d+) step (\d+)", done.output))
    assert len(steps) == 1, done.describe()
    job_id, step_id = steps.pop()
    port = derived_master_port(int(job_id), int(step_id))
    lines = ring_lines(done.output)
    assert sorted(lines) == [0, 1, 2, 3], done.describe()
    # MASTER_ADDR is unset too: every rank takes the step's first node, and the job's port.
    rendezvous = {re.search(r"\(rendezvous (\S+):(\d+)\)$", line).groups() for line in lines.values()}
    assert len(rendezvous) == 1 and rendezvous.pop()[1] == str(port), lines


def test_srun_pmix_runs_the_transfer_scenario(slurm: SlurmCluster) -> None:
    env = {**slurm.env, "MASTER_PORT": str(unused_port())}
    command = [
        "srun", "-n", "4", "--mpi=pmix", f"--time={SLURM_TIME_LIMIT}", sys.executable, "-m", "ncclkv.scenario",
        "--kind", "transfer", "--prefill", "1", "--prefill-tp", "2", "--decode", "1", "--decode-pp", "2",
        "--small", "--deadline", "60",
    ]
    done = run(command, env=env, timeout_s=TIMEOUT_S)
    print(f"srun -n 4 --mpi=pmix transfer 1P(tp2)+1D(pp2): {done.elapsed_s:.1f} s")
    assert done.returncode == 0, done.describe()
    assert "every landed byte checked against the producer's KV: OK" in done.output, done.describe()


@pytest.mark.parametrize("template", TEMPLATES, ids=[path.stem for path in TEMPLATES])
def test_sbatch_template_small(slurm: SlurmCluster, template: Path, tmp_path: Path) -> None:
    ntasks, topology = template_topology(template.read_text())
    assert ntasks == topology.world_size, f"{template.name}: --ntasks={ntasks}, its P/D set has {topology.world_size} ranks"
    out, summary = tmp_path / "job.out", tmp_path / "summary.json"
    env = {**slurm.env, "MASTER_PORT": str(unused_port()), "NCCLKV_SMALL": "1", "PYTHON": sys.executable}
    # the template passes its arguments on to the scenario
    done, output = sbatch_wait([str(template.relative_to(REPO)), "--json-out", str(summary)], env=env, out=out)
    print(f"sbatch --wait {template.name} ({ntasks} tasks): {done.elapsed_s:.1f} s")
    assert done.returncode == 0, f"{done.describe()}\n--- job output\n{output[-6000:]}"
    # The templates run the transfer scenario: rank 0's table has one row per decode rank, and
    # its JSON summary every rank's own report of its place, in rank order, prefill ranks too.
    assert "every landed byte checked against the producer's KV: OK" in output, output
    places = [row["place"] for row in json.loads(summary.read_text())["ranks"]]
    assert places == [str(topology.place(rank)) for rank in range(ntasks)], f"{places}\n{output}"
